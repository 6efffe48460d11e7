//! TLS for the Postgres backend (feature `postgres-tls`): a tokio-postgres connector over
//! rustls (ring). The server's certificate is always verified — against the operating system's
//! root certificates plus any given in
//! [`PostgresOptions::tls_root_certificates`](super::PostgresOptions::tls_root_certificates) —
//! and its name checked against the host of the URL, whatever the `sslmode` (`prefer` still
//! falls back to plaintext when the server has no TLS at all; `require` does not).

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
        Ok(RustlsConnect {
            config: self.config.clone(),
            name: ServerName::try_from(domain.to_owned())?,
        })
    }
}

/// One connection's TLS handshake.
pub(crate) struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let connector = tokio_rustls::TlsConnector::from(self.config);
            Ok(RustlsStream(connector.connect(self.name, stream).await?))
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
