//! Hot reload: files added, changed and removed while a client sends requests; a bad edit is
//! rejected and the old rules keep answering; a ConfigMap-style symlink swap is picked up.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use sluice::clock::ManualClock;
use sluice::engine::{Engine, EngineSettings};
use sluice::rules::reload::Reloader;
use sluice::server::{self, RulesSource};
use sluice::store::MemoryStore;

fn rules(domain: &str, limit: u32, algorithm: &str) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {limit}, algorithm: {algorithm}}}\n"
    )
}

struct Live {
    running: server::Running,
    reloader: Arc<Reloader>,
}

async fn start_live(dir: &Path) -> Live {
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let rules = RulesSource::Files {
        path: dir.to_path_buf(),
        watch: Some(Duration::from_millis(50)),
    };
    let running = server::start(config(rules, memory(&clock, 10_000)))
        .await
        .unwrap();
    let reloader = running.reloader().expect("rules from files reload");
    Live { running, reloader }
}

/// Waits (bounded) until the reloader has done `ok` good and `failed` rejected reloads: the
/// watcher is a separate thread reacting to the file system.
async fn reloaded(live: &Live, ok: u64, failed: u64) -> Duration {
    let started = Instant::now();
    loop {
        let s = live.reloader.status();
        if s.reloads_ok >= ok && s.reloads_failed >= failed {
            assert_eq!(
                (s.reloads_ok, s.reloads_failed),
                (ok, failed),
                "one reload per burst of edits"
            );
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no reload: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn limit_of(live: &Live, domain: &str) -> Option<u32> {
    let mut client = sluice::proto::RateLimitServiceClient::connect(format!(
        "http://{}",
        live.running.grpc_addr
    ))
    .await
    .unwrap();
    let mut r = request(domain, vec![descriptor(&[("k", "probe")])]);
    r.descriptors[0].hits_addend = Some(0);
    let resp = client.should_rate_limit(r).await.unwrap().into_inner();
    resp.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit)
}

/// Writes a file the way editors do: a temporary file renamed over the old one.
fn save(path: &Path, text: &str) {
    let tmp = path.with_extension("swp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_apply_while_traffic_flows_and_no_request_fails() {
    let dir = temp_dir("reload-edits");
    std::fs::write(dir.join("a.yaml"), rules("a", 5, "fixed_window")).unwrap();
    let live = start_live(&dir).await;

    // Traffic throughout: every call must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let (calls, failures) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut traffic = Vec::new();
    for _ in 0..4 {
        let mut client = sluice::proto::RateLimitServiceClient::connect(format!(
            "http://{}",
            live.running.grpc_addr
        ))
        .await
        .unwrap();
        let (stop, calls, failures) = (stop.clone(), calls.clone(), failures.clone());
        traffic.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = request(
                    "a",
                    vec![
                        descriptor(&[("k", &format!("load-{i}"))]),
                        descriptor(&[("k", "x")]),
                    ],
                );
                match client.should_rate_limit(r).await {
                    Ok(_) => calls.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failures.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }

    // Add a domain.
    assert_eq!(limit_of(&live, "b").await, None);
    std::fs::write(dir.join("b.yaml"), rules("b", 7, "gcra")).unwrap();
    let mut latencies = vec![reloaded(&live, 1, 0).await];
    assert_eq!(limit_of(&live, "b").await, Some(7));

    // Change a limit (saved by rename, as editors do); its counter carries over.
    save(&dir.join("b.yaml"), &rules("b", 9, "gcra"));
    latencies.push(reloaded(&live, 2, 0).await);
    assert_eq!(limit_of(&live, "b").await, Some(9));

    // Remove a domain.
    std::fs::remove_file(dir.join("b.yaml")).unwrap();
    latencies.push(reloaded(&live, 3, 0).await);
    assert_eq!(limit_of(&live, "b").await, None);

    stop.store(true, Ordering::Relaxed);
    for t in traffic {
        t.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    assert!(calls.load(Ordering::Relaxed) > 10);
    // Edit to new rules answering, as measured here (debounce 50 ms); see BENCHMARKS.md.
    eprintln!("reload latencies: {latencies:?}");
    live.running.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `POST /json` spends real quota, so a server that was not asked for it has no such endpoint.
#[tokio::test]
async fn the_json_endpoint_is_off_unless_asked_for() {
    let dir = temp_dir("json-off");
    std::fs::write(dir.join("a.yaml"), rules("a", 5, "fixed_window")).unwrap();
    let live = start_live(&dir).await;
    let http = live.running.http_addr;
    let body = r#"{"domain":"a","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    assert_eq!(http_post(http, "/json", body).await.0, 404);
    assert_eq!(http_get(http, "/healthcheck").await.0, 200);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_edit_is_rejected_and_the_old_rules_keep_serving() {
    let dir = temp_dir("reload-bad");
    std::fs::write(dir.join("a.yaml"), rules("a", 5, "fixed_window")).unwrap();
    let live = start_live(&dir).await;
    save(
        &dir.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    reloaded(&live, 0, 1).await;
    assert_eq!(limit_of(&live, "a").await, Some(5), "the old rules answer");
    let (status, body) = http_get(live.running.http_addr, "/healthcheck").await;
    assert_eq!(status, 200, "{body}");
    let (_, body) = http_get(live.running.http_addr, "/config").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let error = v["last_error"].as_str().unwrap();
    assert!(
        error.contains(
            "a.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'"
        ),
        "{error}"
    );
    assert!(v["last_error_at"].as_u64().unwrap() > 0);
    assert_eq!(v["reloads_failed"], 1);

    save(&dir.join("a.yaml"), &rules("a", 6, "fixed_window"));
    reloaded(&live, 1, 1).await;
    assert_eq!(limit_of(&live, "a").await, Some(6));
    let (_, body) = http_get(live.running.http_addr, "/config").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["last_error"].is_null());
    let (_, rlconfig) = http_get(live.running.http_addr, "/rlconfig").await;
    assert_eq!(
        rlconfig,
        "a.k: unit=HOUR requests_per_unit=6, shadow_mode: false, quota_mode: false, algorithm: fixed_window\n"
    );
    live.running.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_is_picked_up() {
    // A Kubernetes ConfigMap volume: files are links into `..data`, itself a link to a
    // timestamped directory; an update makes a new directory and renames a new `..data` over.
    let dir = temp_dir("reload-configmap");
    std::fs::create_dir(dir.join("..2026_12_02_10_00_00.1")).unwrap();
    std::fs::write(
        dir.join("..2026_12_02_10_00_00.1/a.yaml"),
        rules("a", 5, "fixed_window"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_02_10_00_00.1", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/a.yaml", dir.join("a.yaml")).unwrap();
    let live = start_live(&dir).await;
    assert_eq!(limit_of(&live, "a").await, Some(5));

    std::fs::create_dir(dir.join("..2026_12_02_10_05_00.2")).unwrap();
    std::fs::write(
        dir.join("..2026_12_02_10_05_00.2/a.yaml"),
        rules("a", 8, "sliding_log"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_02_10_05_00.2", dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join("..2026_12_02_10_00_00.1")).unwrap();
    reloaded(&live, 1, 0).await;
    assert_eq!(limit_of(&live, "a").await, Some(8));
    live.running.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn an_algorithm_change_starts_a_fresh_counter() {
    let clock = Arc::new(ManualClock::new(1_800_000_000 * S));
    let load = |text: String| sluice::rules::load_texts([("a.yaml", text.as_str())]).unwrap();
    let engine = Engine::new(
        load(rules("a", 2, "fixed_window")),
        MemoryStore::new(clock, 100),
        EngineSettings::default(),
    );
    let req = || sluice::engine::Request {
        domain: "a".into(),
        descriptors: vec![sluice::engine::Descriptor::of(&[("k", "v")], 2)],
    };
    assert_eq!(
        engine.decide(&req()).await.unwrap().code,
        sluice::engine::Code::Ok
    );
    assert_eq!(
        engine.decide(&req()).await.unwrap().code,
        sluice::engine::Code::OverLimit
    );
    engine.replace_rules(load(rules("a", 2, "token_bucket")));
    assert_eq!(
        engine.decide(&req()).await.unwrap().code,
        sluice::engine::Code::Ok,
        "a new counter"
    );
}
