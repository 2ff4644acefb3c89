//! The `sluice` command line: `serve` (its flags become a [`server::Config`](crate::server::Config)
//! in `serve`), the tools that need no server (`validate`, `explain`, `schema`), and those that
//! ask a running one (`probe`, `inspect` and `top`, in `live`).
//! Run as `ratelimit` (or with `SLUICE_REFERENCE_ENV=true`), the reference service's
//! environment is read in too (`reference_env`).

mod live;
pub mod reference_env;
mod serve;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::rules::{LoadOptions, load_path_with};
pub use serve::{Backend, ServeArgs, runtime};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    args_override_self = true,
    about = "A rate limit service for Envoy (RLS v3)"
)]
pub struct Cli {
    /// Log format on stderr; the level comes from RUST_LOG (default info).
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Rules files naming the same domain add their descriptors to it (the reference's
    /// MERGE_DOMAIN_CONFIG); without it a domain in two files is an error.
    #[arg(long, env = "SLUICE_MERGE_DOMAINS", global = true)]
    pub merge_domains: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve ShouldRateLimit on --grpc-addr and /healthcheck, /json on --http-addr.
    #[command(args_override_self = true)]
    Serve(Box<ServeArgs>),
    #[command(flatten)]
    Tool(Tool),
}

/// The commands that need no server.
#[derive(Subcommand)]
pub enum Tool {
    /// Check rules exactly as `serve` loads them.
    Validate {
        /// A YAML file or a directory of *.yaml / *.yml files.
        path: PathBuf,
    },
    /// Exit 0 if the local server is ready (GET /readyz), 1 otherwise: a container HEALTHCHECK.
    Probe {
        #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:8080")]
        http_addr: SocketAddr,
    },
    /// Show what each limit a descriptor touches has used and has left on a running sluice
    /// (its `GET /counters`), without spending anything.
    Inspect {
        #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:8080")]
        http_addr: SocketAddr,
        #[arg(long)]
        domain: String,
        /// One descriptor's entries in order: k=v[,k=v...]. Repeat for several descriptors.
        #[arg(long = "descriptor", required = true)]
        descriptors: Vec<String>,
    },
    /// Who is limited right now: each rule's most-denied descriptor values on a running sluice
    /// (its `GET /top`), refreshed like `top`.
    Top {
        #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:8080")]
        http_addr: SocketAddr,
        /// Values shown per rule.
        #[arg(short, long, default_value_t = 10)]
        n: usize,
        /// How often the view refreshes.
        #[arg(long, default_value = "2s", value_parser = crate::clock::parse_duration)]
        every: Duration,
        /// Print the view once and exit.
        #[arg(long)]
        once: bool,
    },
    /// Print the JSON Schema of rules files (config/sluice-rules.schema.json is this output).
    Schema,
    /// Show what the rules do with a request: the matched rule path (or where matching stopped),
    /// the limits, their algorithms and the counters' storage keys.
    Explain {
        #[arg(long, env = "SLUICE_CONFIG", default_value = "config/")]
        config: PathBuf,
        #[arg(long)]
        domain: String,
        /// One descriptor's entries in order: k=v[,k=v...]. Repeat for several descriptors.
        #[arg(long = "descriptor", required_unless_present = "buckets")]
        descriptors: Vec<String>,
        /// An RLQS bucket id's entries, in any order: k=v[,k=v...]. Repeat for several.
        #[arg(long = "bucket", conflicts_with = "descriptors")]
        buckets: Vec<String>,
        #[arg(long, env = "SLUICE_REDIS_KEY_PREFIX", default_value = "sluice:")]
        redis_key_prefix: String,
    },
}

/// The command line as given, with the reference's environment when sluice runs in its place
/// (invoked as `ratelimit`, the image's `/bin/ratelimit` as Envoy Gateway starts it, with no
/// arguments meaning `serve`; or with `SLUICE_REFERENCE_ENV=true`). A clap error (or `--help`)
/// ends the process as clap does.
pub fn parse() -> Result<(Cli, reference_env::Translation), String> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let as_reference = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "ratelimit");
    let asked = std::env::var("SLUICE_REFERENCE_ENV").is_ok_and(|v| v == "true" || v == "1");
    if as_reference && args.len() == 1 {
        args.push("serve".into());
    }
    let mut reference = if as_reference || asked {
        reference_env::translate(|k| std::env::var(k).ok())
            .map_err(|e| format!("sluice (as the reference service): {e}"))?
    } else {
        reference_env::Translation::default()
    };
    let matches = Cli::command().get_matches_from(args);
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    cli.take(&matches, std::mem::take(&mut reference.settings));
    Ok((cli, reference))
}

impl Cli {
    /// Fills in the reference's settings where the command line and the `SLUICE_*` variables
    /// left an argument at its default. Only `serve` takes them.
    fn take(&mut self, matches: &clap::ArgMatches, settings: Vec<reference_env::Setting>) {
        use clap::parser::ValueSource;
        let given = |m: &clap::ArgMatches, id: &str| {
            matches!(
                m.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        let Command::Serve(args) = &mut self.command else {
            return;
        };
        let Some(serve) = matches.subcommand_matches("serve") else {
            return;
        };
        for setting in settings {
            let Some(global) = args.take(setting, |id| given(serve, id)) else {
                continue;
            };
            let given = |id: &str| given(matches, id) || given(serve, id);
            match global {
                reference_env::Setting::MergeDomains if !given("merge_domains") => {
                    self.merge_domains = true;
                }
                reference_env::Setting::LogFormat(format) if !given("log_format") => {
                    self.log_format = format;
                }
                _ => {}
            }
        }
    }
}

impl Tool {
    pub fn run(self, load: LoadOptions) -> ExitCode {
        match self {
            Tool::Validate { path } => validate(&path, load),
            Tool::Probe { http_addr } => live::probe(http_addr),
            Tool::Inspect {
                http_addr,
                domain,
                descriptors,
            } => live::inspect(http_addr, &domain, &descriptors),
            Tool::Top {
                http_addr,
                n,
                every,
                once,
            } => live::top(http_addr, n, every, once),
            Tool::Schema => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&crate::rules::schema()).unwrap_or_default()
                );
                ExitCode::SUCCESS
            }
            Tool::Explain {
                config,
                domain,
                descriptors,
                buckets,
                redis_key_prefix,
            } => explain(
                &config,
                &domain,
                (&descriptors, &buckets),
                &redis_key_prefix,
                load,
            ),
        }
    }
}

/// `default_level` when `RUST_LOG` is not set. `traces`: the OpenTelemetry layer, when spans
/// are exported (its own filter: only the spans meant for traces, whatever `RUST_LOG` says).
pub fn init_logging(
    format: LogFormat,
    default_level: &str,
    traces: Option<Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>>,
) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.with_filter(filter).boxed(),
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
    };
    tracing_subscriber::registry().with(traces).with(fmt).init();
}

fn validate(path: &std::path::Path, load: LoadOptions) -> ExitCode {
    match load_path_with(path, load) {
        Ok(rules) => {
            println!(
                "ok: {} domains, {} rules",
                rules.domain_count(),
                rules.rule_count()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            println!("{errors}");
            ExitCode::FAILURE
        }
    }
}

/// `explain` of `descriptors`, or of RLQS `buckets` when those are given.
fn explain(
    config: &std::path::Path,
    domain: &str,
    (descriptors, buckets): (&[String], &[String]),
    prefix: &str,
    load: LoadOptions,
) -> ExitCode {
    let rules = match load_path_with(config, load) {
        Ok(rules) => rules,
        Err(errors) => {
            println!("{errors}");
            return ExitCode::FAILURE;
        }
    };
    let (given, flag) = if buckets.is_empty() {
        (descriptors, "--descriptor")
    } else {
        (buckets, "--bucket")
    };
    let parsed: Result<Vec<_>, _> = given
        .iter()
        .map(|d| crate::explain::parse_descriptor(d))
        .collect();
    match parsed {
        Ok(parsed) if buckets.is_empty() => {
            print!(
                "{}",
                crate::explain::explain(&rules, domain, &parsed, prefix)
            );
            ExitCode::SUCCESS
        }
        Ok(parsed) => {
            print!(
                "{}",
                crate::explain::explain_buckets(&rules, domain, &parsed, prefix)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: {flag} {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::reference_env::Setting::{self, *};
    use super::*;

    /// One of each setting, each different from its argument's default.
    fn every_setting() -> Vec<Setting> {
        let addr = |a: &str| a.parse().unwrap();
        vec![
            GrpcAddr(addr("127.0.0.1:1")),
            HttpAddr(addr("127.0.0.1:2")),
            GrpcTlsCert("c".into()),
            GrpcTlsKey("k".into()),
            GrpcTlsClientCa("ca".into()),
            GrpcTlsClientSan("san".into()),
            XdsServer("xds:1".into()),
            XdsNodeId("node".into()),
            XdsNodeMetadata("a=b".into()),
            XdsHeaders("h=v".into()),
            XdsRetryInitial(Duration::from_secs(7)),
            XdsTlsCa("xca".into()),
            XdsTlsCert("xc".into()),
            XdsTlsKey("xk".into()),
            XdsTlsServerName("name".into()),
            XdsStartWithoutRules,
            Config("rules".into()),
            Setting::Backend(super::Backend::RedisCluster),
            RedisUrl("redis://r:1".into()),
            RedisConnectTimeout(Duration::from_secs(3)),
            RedisKeyPrefix("p:".into()),
            ShadowMode,
            QuotaMode,
            ResponseDynamicMetadata,
            MergeDomains,
            NearLimitRatio(0.5),
            ResponseHeaders("ratelimit".into()),
            RatelimitHeaderNames("A,B,C".into()),
            ReferenceMetricsAddr(addr("127.0.0.1:3")),
            ReferenceMetricsPath("/m".into()),
            Setting::LogFormat(super::LogFormat::Json),
        ]
    }

    fn serve_with(args: &[&str], settings: Vec<Setting>) -> Cli {
        let matches = Cli::command().get_matches_from(args);
        let mut cli = Cli::from_arg_matches(&matches).unwrap();
        cli.take(&matches, settings);
        cli
    }

    /// Every setting reaches its argument: the `Debug` of the arguments changes with each one
    /// alone (a setting that filled nothing, or the wrong field twice, would not).
    #[test]
    fn every_setting_fills_its_argument_when_nothing_gave_it() {
        let render = |cli: &Cli| match &cli.command {
            Command::Serve(args) => format!("{args:?} {:?} {}", cli.log_format, cli.merge_domains),
            Command::Tool(_) => String::new(),
        };
        let default = render(&serve_with(&["sluice", "serve"], Vec::new()));
        let mut seen = std::collections::HashSet::new();
        for setting in every_setting() {
            let filled = render(&serve_with(&["sluice", "serve"], vec![setting.clone()]));
            assert_ne!(filled, default, "{setting:?} filled nothing");
            assert!(seen.insert(filled), "{setting:?} filled what another did");
        }
    }

    #[test]
    fn the_command_line_wins_over_a_setting() {
        let cli = serve_with(
            &[
                "sluice",
                "--merge-domains",
                "serve",
                "--grpc-addr",
                "127.0.0.1:9",
            ],
            vec![GrpcAddr("127.0.0.1:1".parse().unwrap()), QuotaMode],
        );
        let Command::Serve(args) = &cli.command else {
            panic!("serve")
        };
        let rendered = format!("{args:?}");
        assert!(rendered.contains("grpc_addr: 127.0.0.1:9"), "{rendered}");
        assert!(rendered.contains("quota_mode: true"), "{rendered}");
    }
}
