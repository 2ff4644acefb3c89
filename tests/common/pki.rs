//! Certificates for TLS tests, made with the `openssl` command line (a real CA, real chains):
//! a directory of `NAME.crt` / `NAME.key` pairs.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Pki {
    pub dir: PathBuf,
}

/// What a leaf certificate may be used for.
#[derive(Clone, Copy)]
pub enum Usage {
    Server,
    Client,
    /// Both, as Envoy Gateway's one certificate for the rate limit service serves its gRPC
    /// listener and presents it to the xDS server.
    Both,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        Self {
            dir: super::temp_dir(name),
        }
    }

    pub fn crt(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.crt"))
    }

    pub fn key(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key"))
    }

    pub fn pem(&self, file: &Path) -> Vec<u8> {
        std::fs::read(file).unwrap()
    }

    /// A self-signed CA `name`.
    pub fn ca(&self, name: &str) -> &Self {
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            path(&self.key(name)),
            "-out",
            path(&self.crt(name)),
        ]);
        self
    }

    /// A leaf `name` signed by CA `ca`, naming `sans` (e.g. `DNS:localhost,IP:127.0.0.1`).
    pub fn leaf(&self, ca: &str, name: &str, sans: &str, usage: Usage) -> &Self {
        let csr = self.dir.join(format!("{name}.csr"));
        let ext = self.dir.join(format!("{name}.ext"));
        let usage = match usage {
            Usage::Server => "serverAuth",
            Usage::Client => "clientAuth",
            Usage::Both => "serverAuth,clientAuth",
        };
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            ),
        )
        .unwrap();
        openssl(&[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            path(&self.key(name)),
            "-out",
            path(&csr),
        ]);
        openssl(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            path(&csr),
            "-CA",
            path(&self.crt(ca)),
            "-CAkey",
            path(&self.key(ca)),
            "-set_serial",
            &format!("{}", std::process::id() as u64 * 1000 + rand_serial()),
            "-extfile",
            path(&ext),
            "-out",
            path(&self.crt(name)),
        ]);
        self
    }

    /// Puts `from`'s pair where `to`'s is, each file replaced whole by a rename (as a secret
    /// remount does), the certificate first.
    pub fn install(&self, from: &str, to: &str) {
        for (src, dst) in [
            (self.crt(from), self.crt(to)),
            (self.key(from), self.key(to)),
        ] {
            self.replace(&dst, &std::fs::read(src).unwrap());
        }
    }

    /// Replaces one file whole.
    pub fn replace(&self, file: &Path, bytes: &[u8]) {
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(tmp, file).unwrap();
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_serial() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temp path")
}

fn openssl(args: &[&str]) {
    let bin = std::env::var("SLUICE_OPENSSL").unwrap_or_else(|_| "openssl".into());
    let out = Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{bin} runs (install openssl): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
