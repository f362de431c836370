//! TLS for the HTTP server (`npu_serving.tls`): the certificate chain and private key read from
//! PEM files into a rustls server config (ring provider, TLS 1.2 and 1.3, ALPN http/1.1), which
//! each accepted connection takes a handle to. `reload` re-reads both files: new connections
//! use the new certificate, connections already open keep theirs, and a file that does not load
//! leaves the old certificate in place. `reload_on_sighup` runs it on every SIGHUP.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// A certificate or key file that cannot be used, naming its config key and path.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {path}: {reason}")]
pub struct TlsError {
    /// `npu_serving.tls.cert` or `npu_serving.tls.key` (or both, when they do not match).
    pub key: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

/// The server's TLS settings, shared by the event loop and the SIGHUP watcher.
#[derive(Clone)]
pub struct TlsAcceptor {
    cert: PathBuf,
    key: PathBuf,
    current: Arc<Mutex<Arc<ServerConfig>>>,
}

impl std::fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsAcceptor")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish()
    }
}

impl TlsAcceptor {
    /// Reads both files; either failing is an error naming its key and file.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let config = server_config(cert, key)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Arc::new(Mutex::new(config)),
        })
    }

    /// The config new connections use.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Re-reads the files. On success new connections use them; on failure the error is
    /// returned and the previous certificate stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = server_config(&self.cert, &self.key)?;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = config;
        Ok(())
    }

    /// Reloads on every SIGHUP (from a small watcher thread), logging the outcome.
    pub fn reload_on_sighup(&self) -> std::io::Result<()> {
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])?;
        let me = self.clone();
        std::thread::Builder::new()
            .name("tls-reload".into())
            .spawn(move || {
                for _ in signals.forever() {
                    match me.reload() {
                        Ok(()) => tracing::info!(
                            cert = %me.cert.display(),
                            "SIGHUP: TLS certificate reloaded; new connections use it"
                        ),
                        Err(e) => tracing::warn!(
                            "SIGHUP: TLS certificate not reloaded, the previous one stays: {e}"
                        ),
                    }
                }
            })?;
        Ok(())
    }
}

fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let err = |k: &'static str, path: &Path, reason: String| TlsError {
        key: k,
        path: path.to_path_buf(),
        reason,
    };
    let cert_pem = std::fs::read(cert)
        .map_err(|e| err("npu_serving.tls.cert", cert, format!("cannot read: {e}")))?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err("npu_serving.tls.cert", cert, format!("not PEM: {e}")))?;
    if chain.is_empty() {
        return Err(err(
            "npu_serving.tls.cert",
            cert,
            "holds no CERTIFICATE block".into(),
        ));
    }
    let key_pem = std::fs::read(key)
        .map_err(|e| err("npu_serving.tls.key", key, format!("cannot read: {e}")))?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        err(
            "npu_serving.tls.key",
            key,
            format!("no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err("npu_serving.tls.cert", cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| {
            err(
                "npu_serving.tls.key",
                key,
                format!("does not fit the certificate {}: {e}", cert.display()),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, c.cert.pem()).unwrap();
        std::fs::write(&key, c.key_pair.serialize_pem()).unwrap();
        (cert, key)
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("npu-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn loads_a_pair_and_names_the_bad_file() {
        let d = scratch("load");
        let (cert, key) = write_pair(&d, "a");
        TlsAcceptor::load(&cert, &key).unwrap();
        let e = TlsAcceptor::load(&d.join("absent.crt"), &key).unwrap_err();
        assert_eq!(e.key, "npu_serving.tls.cert");
        assert!(e.to_string().contains("absent.crt"), "{e}");
        let junk = d.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let e = TlsAcceptor::load(&junk, &key).unwrap_err();
        assert_eq!(e.key, "npu_serving.tls.cert", "{e}");
        let e = TlsAcceptor::load(&cert, &junk).unwrap_err();
        assert_eq!(e.key, "npu_serving.tls.key", "{e}");
        // A key of another certificate.
        let (_, other_key) = write_pair(&d, "b");
        let e = TlsAcceptor::load(&cert, &other_key).unwrap_err();
        assert_eq!(e.key, "npu_serving.tls.key", "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_failed_reload_keeps_the_old_certificate() {
        let d = scratch("reload");
        let (cert, key) = write_pair(&d, "a");
        let tls = TlsAcceptor::load(&cert, &key).unwrap();
        let first = tls.current();
        std::fs::write(&cert, "garbage").unwrap();
        assert!(tls.reload().is_err());
        assert!(Arc::ptr_eq(&first, &tls.current()));
        let (c2, k2) = write_pair(&d, "b");
        std::fs::rename(c2, &cert).unwrap();
        std::fs::rename(k2, &key).unwrap();
        tls.reload().unwrap();
        assert!(!Arc::ptr_eq(&first, &tls.current()));
        let _ = std::fs::remove_dir_all(&d);
    }
}
