//! TLS on the gRPC listener: the server's certificate and key and, for mutual TLS, the CA that
//! client certificates must chain to, all read from PEM files.
//!
//! Certificates rotate while the server runs (cert-manager renewing, a Kubernetes secret
//! remounted, Envoy Gateway's `/certs`), so the files are read again every `reload_every`. When
//! their bytes change, a new rustls config takes over for the *next* handshake; a connection
//! already open keeps the certificate it was made with, as TLS has it. A rotation caught half
//! written (the new certificate beside the old key) does not load: the old config keeps serving,
//! the failure is logged once, and the next tick tries again.
//!
//! tonic's own TLS takes a config once at start, so the listener does its own handshakes
//! ([`ServerTls::accept`]) and hands tonic the finished streams.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

/// Where the listener's certificates live.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The server's certificate chain (leaf first).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Mutual TLS: every client must present a certificate that chains to this CA.
    pub client_ca: Option<PathBuf>,
    /// Mutual TLS: the client certificate must also name this DNS name or IP address (the
    /// reference's `GRPC_CLIENT_TLS_SAN`).
    pub client_san: Option<String>,
    /// How often the files are read again to pick up a rotation.
    pub reload_every: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a PEM file of the expected kind: {detail}", path.display())]
    Pem { path: PathBuf, detail: String },
    #[error("{} holds no certificate", path.display())]
    NoCertificate { path: PathBuf },
    #[error("the certificate {} and the key {} do not make a server identity: {source}", cert.display(), key.display())]
    Identity {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    #[error("the client CA {}: {detail}", path.display())]
    ClientCa { path: PathBuf, detail: String },
    #[error("the client certificate name {0:?} is neither a DNS name nor an IP address")]
    ClientSan(String),
    #[error("a client SAN was given without a client CA: it needs mutual TLS")]
    SanWithoutCa,
    #[error("the TLS handshake timed out")]
    HandshakeTimeout,
    #[error("the TLS handshake failed: {0}")]
    Handshake(std::io::Error),
    #[error("the client certificate does not name {0}")]
    ClientNameMismatch(String),
}

/// The listener's TLS: the live rustls config, swapped whole on rotation.
pub struct ServerTls {
    files: TlsFiles,
    client_san: Option<ServerName<'static>>,
    config: ArcSwap<ServerConfig>,
    /// The files' bytes as last read, so an unchanged tick costs no parse, and a broken
    /// rotation is reported once rather than every tick.
    last_read: Mutex<FileBytes>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// What a reload tick did.
#[derive(Debug)]
pub enum Reload {
    /// The files are as they were.
    Unchanged,
    /// New certificates serve the next handshake.
    Replaced,
    /// The files changed but do not load; the previous config keeps serving.
    Failed(TlsError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FileBytes {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

/// A handshake that takes longer than this is given up (a client that connects and says
/// nothing must not hold a task for ever).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl ServerTls {
    /// Reads and checks the files: an error here stops the server from starting.
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        let client_san = match &files.client_san {
            None => None,
            Some(_) if files.client_ca.is_none() => return Err(TlsError::SanWithoutCa),
            Some(name) => Some(
                ServerName::try_from(name.clone())
                    .map_err(|_| TlsError::ClientSan(name.clone()))?,
            ),
        };
        let bytes = read_files(&files)?;
        let config = build_config(&files, &bytes)?;
        Ok(Self {
            files,
            client_san,
            config: ArcSwap::from_pointee(config),
            last_read: Mutex::new(bytes),
        })
    }

    pub fn reload_every(&self) -> Duration {
        self.files.reload_every
    }

    /// Reads the files again; when they changed and load, the next handshake uses them.
    pub fn reload(&self) -> Reload {
        let bytes = match read_files(&self.files) {
            Ok(bytes) => bytes,
            // A file missing for a moment (a secret being swapped) is a failed reload, not a
            // stop: the config in memory is still good.
            Err(e) => return Reload::Failed(e),
        };
        let mut last = self.last_read.lock().unwrap_or_else(|p| p.into_inner());
        if *last == bytes {
            return Reload::Unchanged;
        }
        let result = build_config(&self.files, &bytes);
        *last = bytes;
        match result {
            Ok(config) => {
                self.config.store(Arc::new(config));
                Reload::Replaced
            }
            Err(e) => Reload::Failed(e),
        }
    }

    /// The TLS handshake on an accepted connection, with the client-name check of mutual TLS.
    pub async fn accept(&self, tcp: TcpStream) -> Result<TlsStream<TcpStream>, TlsError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.load_full());
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
            .await
            .map_err(|_| TlsError::HandshakeTimeout)?
            .map_err(TlsError::Handshake)?;
        if let Some(name) = &self.client_san {
            let (_, connection) = stream.get_ref();
            let named = connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|leaf| webpki::EndEntityCert::try_from(leaf).ok())
                .is_some_and(|leaf| leaf.verify_is_valid_for_subject_name(name).is_ok());
            if !named {
                return Err(TlsError::ClientNameMismatch(name.to_str().into_owned()));
            }
        }
        Ok(stream)
    }
}

fn read_files(files: &TlsFiles) -> Result<FileBytes, TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
    };
    Ok(FileBytes {
        cert: read(&files.cert)?,
        key: read(&files.key)?,
        client_ca: files.client_ca.as_deref().map(read).transpose()?,
    })
}

fn build_config(files: &TlsFiles, bytes: &FileBytes) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(&files.cert, &bytes.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&bytes.key).map_err(|e| TlsError::Pem {
        path: files.key.clone(),
        detail: e.to_string(),
    })?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| identity_error(files, source))?;
    let builder = match (&files.client_ca, &bytes.client_ca) {
        (Some(path), Some(ca)) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates(path, ca)? {
                roots.add(cert).map_err(|e| TlsError::ClientCa {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::ClientCa {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| identity_error(files, source))?;
    // gRPC is HTTP/2; a client that offers ALPN must get h2 (Envoy and grpc-go offer it).
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(chain)
}

fn identity_error(files: &TlsFiles, source: rustls::Error) -> TlsError {
    TlsError::Identity {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    }
}
