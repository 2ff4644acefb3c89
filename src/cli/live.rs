//! The tools that read a running sluice over its HTTP port: `probe` (`GET /readyz`), `inspect`
//! (`GET /counters`) and `top` (`GET /top`), and their tables.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;

/// `GET path` on `addr` (a listener on 0.0.0.0 is reached on loopback), waiting at most
/// `patience` to connect and for each read: the status code and the body.
fn get(addr: SocketAddr, path: &str, patience: Duration) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let addr = if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    };
    let response = (|| -> std::io::Result<String> {
        let mut stream = std::net::TcpStream::connect_timeout(&addr, patience)?;
        stream.set_read_timeout(Some(patience))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        Ok(text)
    })()
    .map_err(|e| format!("{addr}: {e}"))?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{addr} answered what is not HTTP"))?;
    Ok((status, body.to_owned()))
}

/// `GET path`'s JSON body; the server's reason when it answers otherwise than 200.
fn get_json(addr: SocketAddr, path: &str) -> Result<Value, String> {
    let (status, body) = get(addr, path, Duration::from_secs(5))?;
    if status != 200 {
        return Err(format!("{addr} answered: {}", body.trim()));
    }
    serde_json::from_str(&body).map_err(|e| format!("{addr} answered what is not JSON: {e}"))
}

/// `sluice probe`: exits 0 when `/readyz` says ready (the container's health check).
pub fn probe(addr: SocketAddr) -> ExitCode {
    match get(addr, "/readyz", Duration::from_secs(1)) {
        Ok((200, _)) => ExitCode::SUCCESS,
        Ok(_) => {
            eprintln!("sluice: not ready");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice inspect`.
pub fn inspect(addr: SocketAddr, domain: &str, descriptors: &[String]) -> ExitCode {
    let mut query = format!("domain={}", percent_encode(domain));
    for d in descriptors {
        query.push_str(&format!("&descriptor={}", percent_encode(d)));
    }
    match get_json(addr, &format!("/counters?{query}")) {
        Ok(document) => {
            print!("{}", counters_table(&document));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice top`: the view, once or refreshed every `every` until interrupted.
pub fn top(addr: SocketAddr, n: usize, every: Duration, once: bool) -> ExitCode {
    loop {
        let view = get_json(addr, &format!("/top?n={n}")).map(|d| top_table(&d));
        match (view, once) {
            (Ok(table), true) => {
                print!("{table}");
                return ExitCode::SUCCESS;
            }
            // Clear the screen and draw again, as top does.
            (Ok(table), false) => print!("\x1b[2J\x1b[H{table}"),
            (Err(e), _) => {
                eprintln!("sluice: {e}");
                return ExitCode::FAILURE;
            }
        }
        std::thread::sleep(every.max(Duration::from_millis(100)));
    }
}

/// `%`-encodes what a query value cannot carry as is.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~,=/*".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `sluice inspect`'s table of a `GET /counters` answer.
pub fn counters_table(document: &Value) -> String {
    let mut out = String::new();
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    if document["decided_by"] == "failure_policy" {
        let _ = writeln!(
            out,
            "the backend did not answer: these are the failure policy's numbers, not the counters'"
        );
    }
    let descriptors = document["descriptors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for (i, d) in descriptors.iter().enumerate() {
        let entries: Vec<String> = d["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| format!("{}={}", text(&e["key"]), text(&e["value"])))
            .collect();
        let rule = match &d["rule"] {
            serde_json::Value::String(r) => format!("rule {r}"),
            _ => "no rule: not limited".to_owned(),
        };
        let _ = writeln!(out, "descriptor {i}: {} ({rule})", entries.join(", "));
        if let Some(g) = d["rlqs"].as_object() {
            let _ = writeln!(
                out,
                "  RLQS: {} of the window held in grants by {} stream(s) on this node (counted in used)",
                text(&g["held_in_grants"]),
                text(&g["streams"])
            );
        }
        let limits = d["limits"].as_array().cloned().unwrap_or_default();
        if limits.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<14} {:<14} {:>16} {:>10} {:>10} {:>10}",
            "limit", "algorithm", "allows", "used", "remaining", "resets in"
        );
        for l in limits {
            let allows = format!(
                "{}/{}{}",
                text(&l["requests_per_unit"]),
                if l["unit_multiplier"] == 1 {
                    String::new()
                } else {
                    format!("{} ", text(&l["unit_multiplier"]))
                },
                text(&l["unit"]).to_lowercase()
            );
            // A calendar window is the zone's: "1000/month@Europe/Berlin".
            let allows = match l["calendar"].as_str() {
                Some(zone) => format!("{allows}@{zone}"),
                None => allows,
            };
            let over = if l["over_limit"] == true { " OVER" } else { "" };
            let _ = writeln!(
                out,
                "  {:<14} {:<14} {:>16} {:>10} {:>10} {:>9.1}s{over}",
                text(&l["name"]),
                text(&l["algorithm"]),
                allows,
                text(&l["used"]),
                text(&l["remaining"]),
                l["reset_seconds"].as_f64().unwrap_or(0.0),
            );
        }
    }
    out
}

/// `sluice top`'s table of a `GET /top` answer.
pub fn top_table(document: &Value) -> String {
    let mut out = String::new();
    let rules = document["rules"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "most-limited values (counts halve every {} s)",
        document["half_life_seconds"]
    );
    if rules.is_empty() {
        let _ = writeln!(out, "no denials lately");
    }
    for r in rules {
        let _ = writeln!(
            out,
            "{} / {}",
            r["domain"].as_str().unwrap_or("-"),
            r["rule"].as_str().unwrap_or("-")
        );
        let _ = writeln!(out, "  {:>9} {:>9}  value", "denials", "hits");
        for v in r["values"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  {:>9} {:>9}  {}",
                v["denials"],
                v["hits"],
                v["value"].as_str().unwrap_or("-")
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calendar_limit_shows_its_zone() {
        let document = serde_json::json!({"descriptors": [{
            "entries": [{"key": "user", "value": "ann"}],
            "rule": "user",
            "limits": [{
                "name": "monthly", "algorithm": "fixed_window", "requests_per_unit": 1000,
                "unit": "MONTH", "unit_multiplier": 1, "calendar": "Europe/Berlin",
                "used": 3, "remaining": 997, "over_limit": false, "reset_seconds": 30.0,
            }, {
                "name": "hourly", "algorithm": "fixed_window", "requests_per_unit": 5,
                "unit": "HOUR", "unit_multiplier": 1, "calendar": null,
                "used": 1, "remaining": 4, "over_limit": false, "reset_seconds": 10.0,
            }],
        }]});
        let table = counters_table(&document);
        let row = |name: &str| -> Vec<String> {
            let line = table
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap();
            line.split_whitespace().map(str::to_owned).collect()
        };
        assert_eq!(row("monthly")[2], "1000/month@Europe/Berlin", "{table}");
        assert_eq!(row("hourly")[2], "5/hour", "{table}");
    }

    #[test]
    fn rlqs_grants_held_show_under_their_descriptor() {
        let document = serde_json::json!({"descriptors": [{
            "entries": [{"key": "route", "value": "api"}],
            "rule": "route_api",
            "limits": [],
            "rlqs": {"held_in_grants": 100, "streams": 2},
        }, {
            "entries": [{"key": "route", "value": "free"}],
            "rule": null,
            "limits": [],
            "rlqs": null,
        }]});
        let table = counters_table(&document);
        assert!(
            table.contains("  RLQS: 100 of the window held in grants by 2 stream(s) on this node"),
            "{table}"
        );
        assert_eq!(table.matches("RLQS").count(), 1, "{table}");
    }
}
