//! Hot reload: watch the rules path, and on a change (debounced) or on demand (SIGHUP) load the
//! whole set; a set that loads is swapped in atomically, a set with any error is rejected whole
//! and the old rules keep serving. Rules pushed from elsewhere (xDS) go through the same gate,
//! [`Reloader::offer`], so they are counted, logged and reported alike.
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

/// Hears of every offered set, applied or rejected (the metrics implement it; the rules know
/// nothing of them).
pub trait ReloadObserver: Send + Sync + 'static {
    fn reload(&self, ok: bool);
}

pub struct Reloader {
    /// The rules files; None when the rules are pushed (xDS).
    path: Option<PathBuf>,
    /// Where the rules come from, for logs and the status endpoint.
    source: String,
    load: LoadOptions,
    status: Mutex<ReloadStatus>,
    apply: Apply,
    observer: Option<Arc<dyn ReloadObserver>>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("source", &self.source)
            .finish()
    }
}

impl Reloader {
    /// Rules from files at `path`. `apply` swaps a loaded set in; `initial` describes the set
    /// already serving.
    pub fn new(
        path: PathBuf,
        initial: &RuleSet,
        apply: impl Fn(RuleSet) + Send + Sync + 'static,
    ) -> Self {
        let source = path.display().to_string();
        Self::with_source(Some(path), source, Some(initial), Box::new(apply))
    }

    /// Rules that `source` (e.g. an xDS server) pushes through [`Reloader::offer`]; none serve
    /// until the first arrives.
    pub fn pushed(source: String, apply: impl Fn(RuleSet) + Send + Sync + 'static) -> Self {
        Self::with_source(None, source, None, Box::new(apply))
    }

    fn with_source(
        path: Option<PathBuf>,
        source: String,
        initial: Option<&RuleSet>,
        apply: Apply,
    ) -> Self {
        Self {
            path,
            source,
            load: LoadOptions::default(),
            status: Mutex::new(ReloadStatus {
                loaded_at: initial.map(|_| SystemTime::now()),
                domains: initial.map_or(0, RuleSet::domain_count),
                rules: initial.map_or(0, RuleSet::rule_count),
                ..ReloadStatus::default()
            }),
            apply,
            observer: None,
        }
    }

    /// Loads with `options` (as the serving set was loaded).
    pub fn with_load_options(mut self, options: LoadOptions) -> Self {
        self.load = options;
        self
    }

    /// Reload results go to `observer`.
    pub fn with_observer(mut self, observer: Arc<dyn ReloadObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The rules files; None when the rules are pushed.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The loading options (as the serving set was loaded).
    pub fn load_options(&self) -> LoadOptions {
        self.load
    }

    /// Where the rules come from: the files' path, or the server that pushes them.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn status(&self) -> ReloadStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Loads the whole set now; swaps it in, or keeps the old one and records why. Pushed
    /// rules have nothing to load again: Ok.
    pub fn reload(&self) -> Result<(), RuleErrors> {
        let Some(path) = &self.path else {
            tracing::info!(source = %self.source, "the rules are pushed; nothing to reload");
            return Ok(());
        };
        self.offer(load_path_with(path, self.load))
    }

    /// Swaps a loaded set in, or keeps the old one and records why.
    pub fn offer(&self, result: Result<RuleSet, RuleErrors>) -> Result<(), RuleErrors> {
        if let Some(o) = &self.observer {
            o.reload(result.is_ok());
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
                    source = %self.source,
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
        let Some(path) = self.path.clone() else {
            return Err(notify::Error::generic("pushed rules have no path to watch"));
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Access events (reads) change nothing; everything else may.
                if event.is_ok_and(|e| !e.kind.is_access()) {
                    let _ = tx.send(());
                }
            })?;
        let target = if path.is_dir() {
            path.clone()
        } else {
            path.parent()
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
