//! The layering of `dlock-runtime` (see `ARCHITECTURE.md`), checked on the source: every
//! `crate::<module>` path in code (comments and doc comments aside) goes from a top-level module
//! to one in the same layer or a lower one, and the modules of one layer do not name each other
//! in a cycle. A new top-level module must be placed in a layer here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. Keep in step with `ARCHITECTURE.md`.
const LAYERS: &[(&str, &[&str])] = &[
    ("basics", &["error", "util", "key", "context", "metrics"]),
    ("backend", &["backend"]),
    ("lease", &["watchdog", "lease"]),
    (
        "core",
        &["strategy", "defer", "guard", "locker", "multi", "private"],
    ),
    (
        "features",
        &["idempotency", "durable", "conformance", "admin", "election"],
    ),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).expect("read src dir") {
            rust_files(&entry.expect("dir entry").path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_owned());
    }
}

/// The top-level modules each top-level module names with a `crate::<module>` path in code.
fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 name")
            .to_owned();
        if name == "lib" {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&path, &mut files);
        let deps = edges.entry(name.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read source");
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or("");
                let mut rest = code;
                while let Some(at) = rest.find("crate::") {
                    rest = &rest[at + "crate::".len()..];
                    let module: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    let is_module = rest[module.len()..].starts_with("::");
                    if is_module && module != name && layer_of(&module).is_some() {
                        deps.insert(module);
                    }
                }
            }
        }
    }
    edges
}

#[test]
fn every_top_level_module_has_a_layer() {
    for module in edges().keys() {
        assert!(
            layer_of(module).is_some(),
            "src/{module}: add it to a layer in tests/layering.rs and ARCHITECTURE.md"
        );
    }
}

#[test]
fn modules_only_name_their_own_layer_or_lower_ones() {
    let mut wrong = Vec::new();
    for (module, deps) in edges() {
        let Some(own) = layer_of(&module) else {
            continue;
        };
        for dep in deps {
            let theirs = layer_of(&dep).expect("a layered module");
            if theirs > own {
                wrong.push(format!(
                    "{module} ({}) names {dep} ({})",
                    LAYERS[own].0, LAYERS[theirs].0
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "upward imports:\n{}", wrong.join("\n"));
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let edges = edges();
    // Depth-first search for a back edge.
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_owned());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for dep in edges.get(m).into_iter().flatten() {
            if let Some(cycle) = visit(dep, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for m in edges.keys() {
        if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}
