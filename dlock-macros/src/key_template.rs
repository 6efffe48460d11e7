//! The key mini-language: `"user:<id>:order:<req.order_no>"`.
//!
//! A template is literal text with placeholders in angle brackets. A placeholder names a
//! parameter, a name bound by a parameter pattern, or `self`, optionally followed by a field path
//! (`<req.order_no>`, `<pair.0>`, `<self.tenant>`).
//!
//! Parsing here is purely textual; which names exist is decided by `expand` against the
//! function signature. Every error is a message the caller spans on the key literal.

use std::fmt::{self, Write as _};

/// A parsed key template: literal text and placeholders, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template {
    pub(crate) segments: Vec<Segment>,
}

/// One piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Segment {
    /// Literal text, passed to `KeyBuilder::lit`.
    Lit(String),
    /// A placeholder, whose value is passed to `KeyBuilder::value`.
    Value(Placeholder),
}

/// `<root.field.field>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placeholder {
    /// A parameter or pattern-bound name, or `self`.
    pub(crate) root: String,
    /// Field accesses after the root, outermost first.
    pub(crate) fields: Vec<Field>,
}

/// One `.field` step of a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Field {
    /// `.order_no`
    Named(String),
    /// `.0`
    Index(u32),
}

impl fmt::Display for Placeholder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('<')?;
        f.write_str(&self.root)?;
        for field in &self.fields {
            match field {
                Field::Named(name) => write!(f, ".{name}")?,
                Field::Index(index) => write!(f, ".{index}")?,
            }
        }
        f.write_char('>')
    }
}

/// Characters that may not appear in the literal text of a key, besides whitespace and control
/// characters: the runtime uses them for Redis Cluster hash tags and for escaping values.
const RESERVED: &[char] = &['{', '}', '%', '#'];

impl Template {
    /// Parses `text`; on failure returns every problem found, as messages.
    pub(crate) fn parse(text: &str) -> Result<Template, Vec<String>> {
        let mut errors = Vec::new();
        if text.is_empty() {
            errors.push(
                "the key must not be empty: write literal text and placeholders, \
                 e.g. `key = \"order:<id>\"`"
                    .to_owned(),
            );
            return Err(errors);
        }

        let mut segments = Vec::new();
        let mut literal = String::new();
        // Reserved characters found in literal text, described, each once.
        let mut reserved: Vec<String> = Vec::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            let offset = text.len() - rest.len();
            match c {
                '<' => {
                    let after = &rest[1..];
                    // A placeholder ends at the first `>`; a `<` before it means this one is
                    // never closed.
                    match after.find(['<', '>']) {
                        Some(end) if after[end..].starts_with('>') => {
                            let inner = &after[..end];
                            rest = &after[end + 1..];
                            if !literal.is_empty() {
                                segments.push(Segment::Lit(std::mem::take(&mut literal)));
                            }
                            match parse_placeholder(inner) {
                                Ok(placeholder) => segments.push(Segment::Value(placeholder)),
                                Err(message) => errors.push(message),
                            }
                        }
                        found => {
                            let unclosed = match found {
                                Some(end) => &rest[..=end],
                                None => rest,
                            };
                            errors.push(format!(
                                "unclosed placeholder `{unclosed}` in the key: \
                                 every `<` needs a matching `>`, as in `<id>`"
                            ));
                            rest = match found {
                                Some(end) => &after[end..],
                                None => "",
                            };
                        }
                    }
                    continue;
                }
                '>' => errors.push(format!(
                    "stray `>` in the key after `{}`: `>` may only close a placeholder \
                     such as `<id>`",
                    &text[..offset]
                )),
                c if RESERVED.contains(&c) || c.is_whitespace() || c.is_control() => {
                    let what = describe(c);
                    if !reserved.contains(&what) {
                        reserved.push(what);
                    }
                }
                c => literal.push(c),
            }
            rest = &rest[c.len_utf8()..];
        }
        if !literal.is_empty() {
            segments.push(Segment::Lit(literal));
        }
        if !reserved.is_empty() {
            errors.push(format!(
                "the key contains {}: the literal text of a key may not contain `{{`, `}}`, \
                 `%`, `#`, whitespace or control characters (the runtime reserves `{{` and `}}` \
                 for Redis Cluster hash tags, and `%` and `#` for its encoding of keys)",
                join_and(&reserved)
            ));
        }

        check_separators(&segments, &mut errors);
        let literal_len: usize = segments
            .iter()
            .map(|s| match s {
                Segment::Lit(text) => text.len(),
                Segment::Value(_) => 0,
            })
            .sum();
        if literal_len > dlock_limits::MAX_KEY_INPUT_LEN {
            errors.push(format!(
                "the key's literal text is {literal_len} bytes long: a key may have at most {} \
                 bytes of input, literal text and values together, so every call would fail \
                 with `LockError::InvalidKey`",
                dlock_limits::MAX_KEY_INPUT_LEN
            ));
        }
        if errors.is_empty() {
            Ok(Template { segments })
        } else {
            Err(errors)
        }
    }
}

/// Two placeholders must be separated by literal text that contains `:`.
fn check_separators(segments: &[Segment], errors: &mut Vec<String>) {
    let mut previous: Option<&Placeholder> = None;
    let mut separated = false;
    for segment in segments {
        match segment {
            Segment::Lit(text) => separated |= text.contains(':'),
            Segment::Value(placeholder) => {
                if let (Some(previous), false) = (previous, separated) {
                    errors.push(format!(
                        "placeholders `{previous}` and `{placeholder}` must be separated by \
                         literal text containing `:`, e.g. `{previous}:{placeholder}`; \
                         dlock escapes `:` inside interpolated values, so a `:` between two \
                         values is what keeps keys distinct (without it, the values \
                         (\"1\", \"23\") and (\"12\", \"3\") would build the same key)"
                    ));
                }
                previous = Some(placeholder);
                separated = false;
            }
        }
    }
}

fn parse_placeholder(inner: &str) -> Result<Placeholder, String> {
    if inner.is_empty() {
        return Err(
            "empty placeholder `<>` in the key: write the name of a parameter \
                    between the angle brackets, as in `<id>`"
                .to_owned(),
        );
    }
    let mut parts = inner.split('.');
    let root = parts.next().unwrap_or_default();
    if root != "self" && !is_identifier(root) {
        return Err(format!(
            "invalid placeholder `<{inner}>` in the key: a placeholder is a parameter name \
             (or `self`) optionally followed by fields, as in `<id>`, `<req.order_no>` \
             or `<pair.0>`"
        ));
    }
    let mut fields = Vec::new();
    for part in parts {
        let field = if is_identifier(part) {
            Field::Named(part.to_owned())
        } else if is_tuple_index(part) {
            match part.parse() {
                Ok(index) => Field::Index(index),
                Err(_) => return Err(format!("tuple index `{part}` in `<{inner}>` is too large")),
            }
        } else {
            let what = if part.is_empty() {
                "an empty field".to_owned()
            } else {
                format!("the invalid field `{part}`")
            };
            return Err(format!(
                "invalid placeholder `<{inner}>` in the key: it has {what}; fields are \
                 identifiers or tuple indices, as in `<req.order_no>` or `<pair.0>`"
            ));
        };
        fields.push(field);
    }
    Ok(Placeholder {
        root: root.to_owned(),
        fields,
    })
}

/// A plain (non-raw) Rust identifier; `_` alone is not one.
fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) if first == '_' || first.is_alphabetic() => {
            text != "_" && chars.all(|c| c == '_' || c.is_alphanumeric())
        }
        _ => false,
    }
}

/// `0`, `1`, `12`, … (no leading zeros, as rustc requires).
fn is_tuple_index(text: &str) -> bool {
    !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'))
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// How a reserved character is named in error messages.
fn describe(c: char) -> String {
    match c {
        ' ' => "a space".to_owned(),
        '\t' => "a tab".to_owned(),
        '\n' => "a newline".to_owned(),
        '\r' => "a carriage return".to_owned(),
        c if c.is_whitespace() => format!("whitespace (U+{:04X})", u32::from(c)),
        c if c.is_control() => format!("a control character (U+{:04X})", u32::from(c)),
        c => format!("`{c}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(text: &str) -> Segment {
        Segment::Lit(text.to_owned())
    }

    fn value(root: &str, fields: &[Field]) -> Segment {
        Segment::Value(Placeholder {
            root: root.to_owned(),
            fields: fields.to_vec(),
        })
    }

    fn named(name: &str) -> Field {
        Field::Named(name.to_owned())
    }

    fn parse(text: &str) -> Vec<Segment> {
        match Template::parse(text) {
            Ok(template) => template.segments,
            Err(errors) => panic!("{text:?} should parse, got {errors:?}"),
        }
    }

    /// The single error for `text`.
    fn error(text: &str) -> String {
        match Template::parse(text) {
            Ok(template) => panic!("{text:?} should fail, got {template:?}"),
            Err(errors) => {
                assert_eq!(errors.len(), 1, "{text:?}: {errors:?}");
                errors.into_iter().next().unwrap_or_default()
            }
        }
    }

    #[test]
    fn literal_only() {
        assert_eq!(parse("report:daily"), vec![lit("report:daily")]);
    }

    #[test]
    fn literal_text_over_the_key_input_limit_is_refused() {
        let limit = dlock_limits::MAX_KEY_INPUT_LEN;
        let longest = format!("{}:<id>", "k".repeat(limit - 1));
        assert_eq!(
            parse(&longest),
            vec![
                lit(&format!("{}:", "k".repeat(limit - 1))),
                value("id", &[])
            ]
        );
        let over = format!("{}:<id>", "k".repeat(limit));
        let message = error(&over);
        assert!(
            message.contains(&format!("{} bytes long", limit + 1))
                && message.contains(&format!("at most {limit}")),
            "{message}"
        );
    }

    #[test]
    fn placeholders_and_fields() {
        assert_eq!(
            parse("user:<id>:order:<req.order_no>"),
            vec![
                lit("user:"),
                value("id", &[]),
                lit(":order:"),
                value("req", &[named("order_no")]),
            ]
        );
        assert_eq!(
            parse("<pair.0>:<self.tenant.id>:<a.b.10>"),
            vec![
                value("pair", &[Field::Index(0)]),
                lit(":"),
                value("self", &[named("tenant"), named("id")]),
                lit(":"),
                value("a", &[named("b"), Field::Index(10)]),
            ]
        );
        assert_eq!(parse("<id>"), vec![value("id", &[])]);
        assert_eq!(parse("<_id>x"), vec![value("_id", &[]), lit("x")]);
        assert_eq!(
            parse("ключ:<номер>"),
            vec![lit("ключ:"), value("номер", &[])]
        );
    }

    #[test]
    fn separators_need_a_colon() {
        assert_eq!(
            parse("<a>:<b>"),
            vec![value("a", &[]), lit(":"), value("b", &[])]
        );
        assert_eq!(parse("<a>-x:y-<b>").len(), 3);
        let message = error("<a><b>");
        assert!(
            message.contains("`<a>` and `<b>` must be separated"),
            "{message}"
        );
        assert!(message.contains("escapes `:`"), "{message}");
        let message = error("user:<a>-<b.c>");
        assert!(message.contains("`<a>` and `<b.c>`"), "{message}");
    }

    #[test]
    fn empty_key_and_placeholder() {
        assert!(error("").contains("must not be empty"));
        assert!(error("a:<>").contains("empty placeholder `<>`"));
    }

    #[test]
    fn unclosed_and_stray() {
        let message = error("user:<id");
        assert!(message.contains("unclosed placeholder `<id`"), "{message}");
        let message = error("user:<id:<x>");
        assert!(message.contains("unclosed placeholder `<id:`"), "{message}");
        let message = error("user:id>");
        assert!(message.contains("stray `>`"), "{message}");
        assert!(message.contains("after `user:id`"), "{message}");
    }

    #[test]
    fn reserved_characters() {
        for (text, what) in [
            ("a{b", "`{`"),
            ("a}b", "`}`"),
            ("a%b", "`%`"),
            ("a#b", "`#`"),
            ("a b", "a space"),
            ("a\tb", "a tab"),
            ("a\nb", "a newline"),
            ("a\u{7}b", "a control character (U+0007)"),
            ("a\u{a0}b", "whitespace (U+00A0)"),
        ] {
            let message = error(text);
            assert!(
                message.contains(&format!("contains {what}")),
                "{text:?}: {message}"
            );
        }
    }

    #[test]
    fn invalid_placeholders() {
        for text in ["<1>", "<a b>", "<a-b>", "<_>", "<{a}>", "<.a>"] {
            assert!(
                error(text).contains("invalid placeholder"),
                "{text:?} should be an invalid placeholder"
            );
        }
        assert!(error("<a.>").contains("an empty field"));
        assert!(error("<a..b>").contains("an empty field"));
        assert!(error("<a.01>").contains("the invalid field `01`"));
        assert!(error("<a.b c>").contains("the invalid field `b c`"));
        assert!(error("<a.99999999999>").contains("too large"));
    }

    #[test]
    fn reports_every_problem() {
        let errors = Template::parse("a b:<>:c%d e<x").expect_err("three problems");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(
            errors[2].starts_with("the key contains a space and `%`:"),
            "{errors:?}"
        );
        let message = error("{a} b");
        assert!(
            message.starts_with("the key contains `{`, `}` and a space:"),
            "{message}"
        );
    }

    #[test]
    fn placeholder_display() {
        let template = Template::parse("<a.b.0>").expect("valid");
        let [Segment::Value(placeholder)] = &template.segments[..] else {
            panic!("one placeholder expected")
        };
        assert_eq!(placeholder.to_string(), "<a.b.0>");
    }
}
