//! The `sluice` command: parse the command line (`cli`), then either run a tool or serve
//! (`server::run`) until SIGTERM or SIGINT.

use std::process::ExitCode;

use anyhow::Context;
use futures_util::Stream;
use sluice::cli::{self, Command};
use sluice::rules::LoadOptions;

// mimalloc, called as `sluice::allocator` explains.
#[global_allocator]
static ALLOCATOR: sluice::allocator::Mimalloc = sluice::allocator::Mimalloc;

fn main() -> ExitCode {
    let (cli, reference) = match cli::parse() {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // Spans are exported only when serving, and only with an endpoint configured.
    let traces = match &cli.command {
        Command::Serve(_) => {
            match sluice::trace::from_env(|k| std::env::var(k).ok(), reference.as_reference) {
                Ok(config) => config.map(|c| sluice::trace::Tracing::new(&c)),
                Err(e) => {
                    eprintln!("sluice: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        Command::Tool(_) => None,
    };
    cli::init_logging(
        cli.log_format,
        reference.log_level.as_deref().unwrap_or("info"),
        traces.as_ref().map(sluice::trace::Tracing::layer),
    );
    for (var, why) in reference.ignored {
        tracing::info!(variable = var, "reference setting not needed: {why}");
    }
    let load = LoadOptions {
        merge_domains: cli.merge_domains,
    };
    match cli.command {
        Command::Tool(tool) => tool.run(load),
        Command::Serve(args) => match serve(&args, load, traces) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

fn serve(
    args: &cli::ServeArgs,
    load: LoadOptions,
    traces: Option<sluice::trace::Tracing>,
) -> anyhow::Result<()> {
    let config = args.config(load)?;
    let runtime = cli::runtime(args.worker_threads()).context("starting the async runtime")?;
    runtime.block_on(async move {
        // First thing inside the runtime: a SIGTERM from here on stops gracefully.
        let signals = shutdown_signals();
        let traces = traces.map(|mut t| {
            let worker = t.worker().map(tokio::spawn);
            (t, worker)
        });
        let ran = sluice::server::run(config, signals).await;
        if let Some((traces, worker)) = traces {
            // What the last calls' spans still wait for: at most one export's time.
            traces.stop(worker, std::time::Duration::from_secs(2)).await;
        }
        ran
    })
}

/// One item per SIGTERM or SIGINT. SIGTERM is registered now: one that arrived before would end
/// the process without a graceful stop or the leases' return.
fn shutdown_signals() -> impl Stream<Item = ()> + Unpin {
    use tokio::signal::unix::{SignalKind, signal};
    let term = match signal(SignalKind::terminate()) {
        Ok(term) => Some(term),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; stopping on SIGINT only");
            None
        }
    };
    Box::pin(futures_util::stream::unfold(term, |mut term| async move {
        match &mut term {
            Some(t) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        Some(((), term))
    }))
}
