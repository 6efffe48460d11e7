//! TLS for the Postgres backend (feature `postgres-tls`): a tokio-postgres connector over
//! rustls (ring). The server's certificate is always verified — against the operating system's
//! root certificates plus any given in
//! [`PostgresOptions::tls_root_certificates`](super::PostgresOptions::tls_root_certificates) —
//! and its name checked against the host of the URL, whatever the `sslmode` (`prefer` still
//! falls back to plaintext when the server has no TLS at all; `require` does not).
//!
//! A Unix-socket host has no name to check, and no TLS: tokio-postgres asks this connector for
//! one with the name `""` anyway (before it knows whether the server offers TLS), and the
//! server answers a TLS request on a socket with "no", so `prefer` goes on in plaintext. Once,
//! `""` failed as an invalid DNS name here, and with it every connection to a socket host
//! under the default `sslmode=prefer`. (`require` with a socket host is refused before any
//! connection, by [`Connector::for_config`](super::Connector).)

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, InvalidDnsNameError, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::Socket;

use crate::LockError;

/// Makes a TLS connector per connection (the server name comes from the URL's host).
#[derive(Clone)]
pub(crate) struct MakeRustls {
    config: Arc<rustls::ClientConfig>,
}

impl MakeRustls {
    /// The OS's roots plus `extra_pem` (PEM certificates).
    pub(crate) fn new(extra_pem: Option<&[u8]>) -> Result<Self, LockError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        if let Some(pem) = extra_pem {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|_| {
                    LockError::misconfigured("postgres tls: unreadable root certificate PEM", None)
                })?;
                roots.add(cert).map_err(|_| {
                    LockError::misconfigured("postgres tls: invalid root certificate", None)
                })?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|_| LockError::misconfigured("postgres tls: no protocol versions", None))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(MakeRustls {
            config: Arc::new(config),
        })
    }
}

impl MakeTlsConnect<Socket> for MakeRustls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, InvalidDnsNameError> {
        // `""`: a Unix socket (see the module docs).
        let name = if domain.is_empty() {
            None
        } else {
            Some(ServerName::try_from(domain.to_owned())?)
        };
        Ok(RustlsConnect {
            config: self.config.clone(),
            name,
        })
    }
}

/// One connection's TLS handshake.
pub(crate) struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    /// `None` over a Unix socket.
    name: Option<ServerName<'static>>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            // Never reached over a socket: a server does not offer TLS there, and tokio-postgres
            // refuses a handshake without a host name before it gets here.
            let Some(name) = self.name else {
                return Err(io::Error::other("no TLS over a Unix socket"));
            };
            let connector = tokio_rustls::TlsConnector::from(self.config);
            Ok(RustlsStream(connector.connect(name, stream).await?))
        })
    }
}

/// A TLS session to the server.
pub(crate) struct RustlsStream(tokio_rustls::client::TlsStream<Socket>);

impl TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
