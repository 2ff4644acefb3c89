//! Hot reload: watch the rules path, and on a change (debounced) or on demand (SIGHUP) load the
//! whole set; a set that loads is swapped in atomically, a set with any error is rejected whole
//! and the old rules keep serving.
//!
//! The watch is on the directory (or, for a single file, on its parent), not recursive: that sees
//! files created, written, removed and renamed, editors' save-by-rename, and the Kubernetes
//! ConfigMap swap (a new `..<timestamp>` directory, then the `..data` symlink renamed over).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::{LoadOptions, RuleErrors, RuleSet, load_path_with};

/// What the last reloads did, for the status endpoint and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadStatus {
    /// When the rules now serving were loaded.
    pub loaded_at: Option<SystemTime>,
    pub domains: usize,
    pub rules: usize,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// The errors of the last rejected reload, and when, until a reload succeeds.
    pub last_error: Option<(SystemTime, String)>,
}

type Apply = Box<dyn Fn(RuleSet) + Send + Sync>;

pub struct Reloader {
    path: PathBuf,
    load: LoadOptions,
    status: Mutex<ReloadStatus>,
    apply: Apply,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("path", &self.path)
            .finish()
    }
}

impl Reloader {
    /// `apply` swaps a loaded set in; `initial` describes the set already serving.
    pub fn new(
        path: PathBuf,
        initial: &RuleSet,
        apply: impl Fn(RuleSet) + Send + Sync + 'static,
    ) -> Self {
        Self {
            path,
            load: LoadOptions::default(),
            status: Mutex::new(ReloadStatus {
                loaded_at: Some(SystemTime::now()),
                domains: initial.domain_count(),
                rules: initial.rule_count(),
                ..ReloadStatus::default()
            }),
            apply: Box::new(apply),
            metrics: None,
        }
    }

    /// Loads with `options` (as the serving set was loaded).
    pub fn with_load_options(mut self, options: LoadOptions) -> Self {
        self.load = options;
        self
    }

    /// Reload results go to `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn status(&self) -> ReloadStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Loads the whole set now; swaps it in, or keeps the old one and records why.
    pub fn reload(&self) -> Result<(), RuleErrors> {
        let result = load_path_with(&self.path, self.load);
        if let Some(m) = &self.metrics {
            m.observe_reload(result.is_ok());
        }
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(rules) => {
                status.loaded_at = Some(SystemTime::now());
                status.domains = rules.domain_count();
                status.rules = rules.rule_count();
                status.reloads_ok += 1;
                status.last_error = None;
                tracing::info!(
                    domains = status.domains,
                    rules = status.rules,
                    "rules reloaded"
                );
                (self.apply)(rules);
                Ok(())
            }
            Err(errors) => {
                for e in &errors.0 {
                    tracing::error!(file = %e.file, location = %e.location, "{}", e.message);
                }
                tracing::error!(
                    errors = errors.0.len(),
                    "rules reload rejected; the previous rules keep serving"
                );
                status.reloads_failed += 1;
                status.last_error = Some((SystemTime::now(), errors.to_string()));
                Err(errors)
            }
        }
    }

    /// Watches the rules path and reloads `debounce` after the last change of a burst. Runs
    /// until the returned guard is dropped.
    pub fn watch(self: &Arc<Self>, debounce: Duration) -> notify::Result<WatchGuard> {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Access events (reads) change nothing; everything else may.
                if event.is_ok_and(|e| !e.kind.is_access()) {
                    let _ = tx.send(());
                }
            })?;
        let target = if self.path.is_dir() {
            self.path.clone()
        } else {
            self.path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        };
        watcher.watch(&target, RecursiveMode::NonRecursive)?;
        let reloader = self.clone();
        let task = tokio::spawn(async move {
            while rx.recv().await.is_some() {
                // Debounce: wait until the events stop for `debounce`.
                loop {
                    match tokio::time::timeout(debounce, rx.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    }
                }
                let reloader = reloader.clone();
                // Loading reads files: keep it off the async workers.
                let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
            }
        });
        Ok(WatchGuard {
            _watcher: Box::new(watcher),
            task,
        })
    }
}

/// Keeps a watch alive; dropping it stops watching.
pub struct WatchGuard {
    _watcher: Box<dyn Watcher + Send>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
