//! One decision in memory: the pure algorithm alone, and a full engine decision (match + key +
//! store) for a 3-descriptor request, per algorithm.
//!
//! cargo bench --bench decision

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use criterion::{Criterion, criterion_group, criterion_main};
use sluice::clock::SystemClock;
use sluice::engine::{Descriptor, Engine, EngineSettings, Request};
use sluice::limiter::{self, Algorithm, Limit, State};
use sluice::rules::load_texts;
use sluice::store::MemoryStore;

/// The memory store's future is ready at once; polling it directly keeps an async runtime's
/// overhead out of the number.
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the memory store never waits"),
    }
}

fn algorithms(c: &mut Criterion) {
    let mut group = c.benchmark_group("algorithm");
    for alg in Algorithm::RATES {
        let limit = Limit::new(alg, 100_000, 1_000_000, None).unwrap();
        let mut state = State::Empty;
        let mut t = 1_800_000_000_000_000u64;
        group.bench_function(alg.name(), |b| {
            b.iter(|| {
                t += 20; // 50 000 per second: under the limit, so every call is admitted.
                let (v, update) = limiter::decide(&limit, black_box(&state), t, 1, 0);
                state.apply(update);
                v
            })
        });
    }
    group.finish();
}

fn engine(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_3_descriptors");
    for alg in Algorithm::RATES {
        let rules = format!(
            "domain: bench\ndescriptors:\n  - key: remote_address\n    rate_limit: {{unit: second, requests_per_unit: 100000, algorithm: {alg}}}\n  - key: api_key\n    rate_limit: {{unit: second, requests_per_unit: 100000, algorithm: {alg}}}\n    descriptors:\n      - key: path\n        rate_limit: {{unit: second, requests_per_unit: 100000, algorithm: {alg}}}\n"
        );
        let rules = load_texts([("bench.yaml", rules.as_str())]).unwrap();
        let store = MemoryStore::new(Arc::new(SystemClock), 10_000_000);
        let engine = Engine::new(rules, store, EngineSettings::default());
        let d = |entries: &[(&str, &str)]| Descriptor::of(entries, 1);
        // 64 clients, so counters spread over shards as in real traffic.
        let requests: Vec<Request> = (0..64)
            .map(|i| Request {
                domain: "bench".into(),
                descriptors: vec![
                    d(&[("remote_address", &format!("10.0.0.{i}"))]),
                    d(&[("api_key", &format!("key-{i}"))]),
                    d(&[("api_key", &format!("key-{i}")), ("path", "/v1/search")]),
                ],
            })
            .collect();
        let mut i = 0;
        group.bench_function(alg.name(), |b| {
            b.iter(|| {
                i = (i + 1) % requests.len();
                now(engine.decide(black_box(&requests[i]))).unwrap()
            })
        });
    }
    group.finish();
}

/// A plan rule whose client map holds 3 clients, then a million: the lookup is a hash map, so
/// the decision should not slow down.
fn plans(c: &mut Criterion) {
    let rules = "domain: p\ndescriptors:\n  - key: client\n    plan: {client: client}\nplans:\n  free: [{unit: second, requests_per_unit: 1000000}]\n  pro: [{unit: second, requests_per_unit: 1000000}]\ndefault_plan: free\n";
    let mut group = c.benchmark_group("plan_decision");
    for clients in [3usize, 1_000_000] {
        let mut map = String::from("domain: p\nclients:\n");
        for i in 0..clients {
            map.push_str(&format!("  key-{i}: pro\n"));
        }
        let loaded = std::time::Instant::now();
        let rules = load_texts([("p.yaml", rules), ("clients.yaml", map.as_str())]).unwrap();
        eprintln!("loaded {clients} clients in {:?}", loaded.elapsed());
        let store = MemoryStore::new(Arc::new(SystemClock), 10_000_000);
        let engine = Engine::new(rules, store, EngineSettings::default());
        let requests: Vec<Request> = (0..64)
            .map(|i| Request {
                domain: "p".into(),
                descriptors: vec![Descriptor {
                    entries: vec![("client".into(), format!("key-{}", i * 7919 % clients))],
                    hits: 1,
                    ..Descriptor::default()
                }],
            })
            .collect();
        let mut i = 0;
        group.bench_function(format!("{clients}_clients"), |b| {
            b.iter(|| {
                i = (i + 1) % requests.len();
                now(engine.decide(black_box(&requests[i]))).unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, algorithms, engine, plans);
criterion_main!(benches);
