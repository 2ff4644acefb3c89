//! The status page at `GET /`, loaded by a real browser (Debian's `chromium`, headless): every
//! section fills from the live endpoints, the explain form answers a question carried in the
//! link, and nothing errs in the console.

mod common;

use common::*;

const RULES: &str = r#"
domain: m
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 10, name: hourly}
"#;

/// The browser: `SLUICE_CHROMIUM`, or `chromium` on the PATH (.ci/run installs Debian's). A
/// missing browser fails the test: a page test that silently skips checks nothing.
fn chromium() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("SLUICE_CHROMIUM") {
        return p.into();
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("chromium"))
            .find(|p| p.exists())
    });
    found.expect(
        "chromium not found: install Debian's chromium (.ci/run does) or set SLUICE_CHROMIUM",
    )
}

/// The page's DOM after its scripts ran, and what the browser logged; `then` is what the
/// browser does with the page: `--dump-dom`, or `--screenshot=<file>`.
fn load(url: &str) -> (String, String) {
    browse(url, "--dump-dom")
}

fn browse(url: &str, then: &str) -> (String, String) {
    let profile = temp_dir("chromium-profile");
    let out = std::process::Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            // A laptop's width: the cards sit three or four to a row.
            "--window-size=1100,1500",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args([then, url])
        .output()
        .expect("chromium runs");
    let _ = std::fs::remove_dir_all(&profile);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The HTML of the section `id`.
fn section<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("<section id=\"{id}\""))
        .unwrap_or_else(|| panic!("no section {id}"));
    let end = dom[start..]
        .find("</section>")
        .map_or(dom.len(), |e| start + e);
    &dom[start..end]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_every_section_in_a_real_browser() {
    // Rules from a folder, so a bad edit can be rejected and its error shown.
    let dir = temp_dir("status-rules");
    std::fs::write(dir.join("m.yaml"), RULES).unwrap();
    let clock = std::sync::Arc::new(sluice::clock::ManualClock::new(1_800_000_000 * S));
    let running = sluice::server::start(sluice::server::Config {
        metrics: Some(std::sync::Arc::new(sluice::metrics::Metrics::new(0.8, 100))),
        ..config(
            sluice::server::RulesSource::Files {
                path: dir.clone(),
                watch: None,
            },
            memory(&clock, 1_000),
        )
    })
    .await
    .unwrap();
    // A file whose name is one long word: its error must wrap inside the rules card.
    let long = format!("{}.yaml", "team-payments-".repeat(10));
    std::fs::write(dir.join(&long), "domain: [").unwrap();
    assert!(running.reloader().unwrap().reload().is_err());
    let server = TestServer { clock, running };
    let mut client = server.client().await;
    for _ in 0..14 {
        client
            .should_rate_limit(request("m", vec![descriptor(&[("k", "heavy-user-7")])]))
            .await
            .unwrap();
    }
    let url = format!(
        "http://{}/?domain=m&descriptor=k%3Dheavy-user-7",
        server.running.http_addr
    );
    let (dom, log) = tokio::task::spawn_blocking(move || load(&url))
        .await
        .unwrap();
    assert!(
        dom.contains("<h1>sluice</h1>"),
        "the page loaded: {dom}\n{log}"
    );
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "the console: {console:#?}");
    assert!(section(&dom, "serving").contains("READY"), "{dom}");
    assert!(section(&dom, "backend").contains("counters in memory"));
    let rules = section(&dom, "rules");
    assert!(rules.contains("<th>rules</th><td>1</td>"), "{rules}");
    assert!(rules.contains(&long), "{rules}");
    // No card runs past its edge, the long error included (the page names any that does).
    assert!(dom.contains("data-overflowing=\"\""), "{dom}");
    // The loaded rules, each with its limits, as /rlconfig words them.
    let loaded = section(&dom, "loaded");
    assert!(loaded.contains("<h3>m</h3>"), "{loaded}");
    assert!(
        loaded.contains("<td>k</td><td>unit=HOUR requests_per_unit=10, shadow_mode: false"),
        "{loaded}"
    );
    assert!(
        section(&dom, "rlqs").contains("<th>streams</th><td>0</td>"),
        "{dom}"
    );
    let rates = section(&dom, "rates");
    assert!(rates.contains("<th>denied</th><td>4 "), "{rates}");
    // The most-limited table: the value masked.
    let top = section(&dom, "top");
    assert!(top.contains("m / k") && top.contains("k=heav…#"), "{top}");
    assert!(
        top.contains("<th>denied requests</th><th>hits denied</th>"),
        "{top}"
    );
    assert!(!top.contains("heavy-user-7"));
    // The question in the link: explained, and its live counter (10 used, 0 left).
    let explain = section(&dom, "explain");
    assert!(explain.contains("rule: m.k"), "{explain}");
    assert!(
        explain.contains("<td class=\"n\">10</td><td class=\"n\">0</td>"),
        "{explain}"
    );
    // The picture, for a person to look at: target/status-page.png.
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let url = format!(
        "http://{}/?domain=m&descriptor=k%3Dheavy-user-7",
        server.running.http_addr
    );
    let arg = format!("--screenshot={}", shot.display());
    tokio::task::spawn_blocking(move || browse(&url, &arg))
        .await
        .unwrap();
    assert!(shot.exists(), "no screenshot at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
    server.running.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
