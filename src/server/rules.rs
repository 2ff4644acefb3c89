//! Keeping the engine's rules live: the [`Reloader`] every rules change goes through, the file
//! watch, SIGHUP, and the xDS client.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;

use super::RulesSource;
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::rules::reload::{ReloadObserver, Reloader, WatchGuard};
use crate::rules::{LoadOptions, RuleSet, load_path_with};
use crate::store::Store;
use crate::xds::XdsRules;

/// The rules in `path`, or why there are none to serve.
fn load_files(path: &Path, load: LoadOptions) -> anyhow::Result<RuleSet> {
    if !path.exists() {
        // The default is relative: started from another directory, it names nothing.
        let resolved = std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf());
        anyhow::bail!(
            "no rules at {} ({}): pass --config FILE_OR_DIRECTORY or set SLUICE_CONFIG",
            path.display(),
            resolved.display()
        );
    }
    let rules = load_path_with(path, load)
        .map_err(|e| anyhow::anyhow!("the rules in {} are invalid:\n{e}", path.display()))?;
    tracing::info!(
        config = %path.display(),
        domains = rules.domain_count(),
        rules = rules.rule_count(),
        "rules loaded"
    );
    Ok(rules)
}

/// The live parts: dropping this stops the watch, the SIGHUP handler and the xDS client.
pub(super) struct Live {
    reloader: Option<Arc<Reloader>>,
    _watch: Option<WatchGuard>,
    sighup: Option<tokio::task::JoinHandle<()>>,
    xds: Option<XdsRules>,
}

impl Live {
    /// Gives `engine` its first rules from `source` and starts what keeps them current; with
    /// xDS and `wait`, returns once the first rules are applied.
    pub(super) async fn start<S: Store>(
        source: RulesSource,
        load: LoadOptions,
        engine: &Arc<Engine<S>>,
        metrics: Option<Arc<Metrics>>,
    ) -> anyhow::Result<Self> {
        let apply = {
            let engine = engine.clone();
            move |rules| engine.replace_rules(rules)
        };
        let (reloader, watch, xds) = match source {
            RulesSource::Given(rules) => {
                engine.replace_rules(rules);
                return Ok(Self {
                    reloader: None,
                    _watch: None,
                    sighup: None,
                    xds: None,
                });
            }
            RulesSource::Files { path, watch } => {
                let rules = load_files(&path, load)?;
                let reloader = Reloader::new(path, &rules, apply);
                engine.replace_rules(rules);
                (reloader, watch, None)
            }
            RulesSource::Xds { options, wait } => {
                let source = format!("xds {} (node {})", options.server, options.node_id);
                (Reloader::pushed(source, apply), None, Some((options, wait)))
            }
        };
        let reloader = reloader.with_load_options(load);
        let reloader = Arc::new(match metrics {
            Some(m) => reloader.with_observer(m as Arc<dyn ReloadObserver>),
            None => reloader,
        });
        let watch = match watch {
            Some(debounce) => Some(
                reloader
                    .watch(debounce)
                    .with_context(|| format!("watching {}", reloader.source()))?,
            ),
            None => None,
        };
        let sighup = Some(reload_on_sighup(reloader.clone()));
        let xds = match xds {
            Some((options, wait)) => {
                let client = XdsRules::start(options, reloader.clone());
                if wait {
                    tracing::info!(source = %reloader.source(), "waiting for the first rules before serving");
                    client.first_rules().await;
                }
                Some(client)
            }
            None => None,
        };
        Ok(Self {
            reloader: Some(reloader),
            _watch: watch,
            sighup,
            xds,
        })
    }

    pub(super) fn reloader(&self) -> Option<Arc<Reloader>> {
        self.reloader.clone()
    }

    pub(super) fn xds(&self) -> Option<&XdsRules> {
        self.xds.as_ref()
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(task) = &self.sighup {
            task.abort();
        }
    }
}

/// SIGHUP reloads the rules (pushed rules have nothing to reload: it is logged). Registered
/// before it returns, so a SIGHUP that arrives once serving never takes its default action
/// (ending the process).
fn reload_on_sighup(reloader: Arc<Reloader>) -> tokio::task::JoinHandle<()> {
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    tokio::spawn(async move {
        let Ok(mut hup) = hup else {
            tracing::warn!("cannot watch SIGHUP; reload by editing the rules instead");
            return;
        };
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the rules");
            let reloader = reloader.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
        }
    })
}
