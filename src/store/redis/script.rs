//! The limiter's Lua: one file per algorithm (each the twin of its Rust module under
//! `src/limiter`), a prelude of exact integer helpers, and the batch driver, joined into one
//! body that runs once per slot group of a request.
//!
//! The body is loaded once per Redis server as a Functions library (`FUNCTION LOAD`, Redis 7+)
//! and called with `FCALL`. The library's top level — every algorithm's function definitions —
//! then runs once, at load; sent as a script (`EVALSHA`) it ran on every call, ~3 µs of a
//! call's ~20 (BENCHMARKS.md). The library and its function are named after a hash of the
//! body, so in a rollout the nodes of each version call their own code, and loading never
//! replaces another version's. Functions live in the server's data set (replicated to
//! replicas, kept in its RDB/AOF); a server that lost them (restarted without persistence, a
//! new cluster master, `FUNCTION FLUSH`) answers "Function not found", and the call loads the
//! library and runs again. A server without Functions (Redis 6, an ACL or a proxy that refuses
//! `FUNCTION`) gets the same body as a script: `EVALSHA`, with `SCRIPT LOAD` on NOSCRIPT,
//! decided once per store and logged.

use std::sync::atomic::{AtomicBool, Ordering};

use redis::aio::ConnectionLike;
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind};

/// The joined files, in the order each needs the ones before it.
macro_rules! body {
    () => {
        concat!(
            include_str!("lua/prelude.lua"),
            "\n",
            include_str!("lua/fixed_window.lua"),
            "\n",
            include_str!("lua/sliding_window.lua"),
            "\n",
            include_str!("lua/sliding_log.lua"),
            "\n",
            include_str!("lua/bucket.lua"),
            "\n",
            include_str!("lua/concurrency.lua"),
            "\n",
            include_str!("lua/batch.lua"),
        )
    };
}

/// What makes the body a script (`EVAL`): it ends by running `batches` on the call's keys and
/// arguments.
macro_rules! script_end {
    () => {
        "\nreturn batches(KEYS, ARGV)\n"
    };
}

/// The body as a script.
pub const LIMITER_SCRIPT: &str = concat!(body!(), script_end!());

/// One request's checks for one slot: the keys, the time, and the checks' arguments (see
/// `batch.lua`). A call carries one or more groups (see `batcher`).
#[derive(Debug, Clone, Default)]
pub struct Group {
    pub keys: Vec<Vec<u8>>,
    /// None: Redis `TIME`; or a pinned time in microseconds (tests only).
    pub now: Option<u64>,
    pub args: Vec<u64>,
    /// The request's span for this group, when it is traced: the call that carries the group
    /// links it (`trace::redis_call`). Boxed: a span's context holds a 128-bit trace id, and
    /// inline it would align every future holding a group (the whole shared stack's, boxed per
    /// request) to 16 bytes, which mimalloc serves by its slow aligned path (~300 instructions
    /// a request, `scripts/instructions redis`).
    pub trace: Option<Box<opentelemetry::trace::SpanContext>>,
}

/// What one group answered: the time Redis decided at and per check its verdict's four
/// integers (allowed, remaining, reset, retry), or the text of the error the group raised (its
/// neighbours in the call are answered on their own).
pub type GroupAnswer = Result<(i64, Vec<i64>), String>;

/// The limiter's code on a Redis server: as a Functions library, or as a script where the
/// server has no Functions.
pub struct Limiter {
    /// `sluice_<hash of the body>`: the library's name and its one function's.
    name: String,
    /// `FUNCTION LOAD`'s argument.
    library: String,
    /// The body as a script (`EVALSHA`, and `SCRIPT LOAD` where the server lost it).
    script: redis::Script,
    /// The server refused Functions once: scripts from then on.
    scripts_only: AtomicBool,
    /// Held while a call loads the library.
    loading: tokio::sync::Mutex<()>,
}

/// The line of the prelude that says whether fixed windows read the string form too (see
/// `RedisOptions::read_string_windows`); the library that does differs from the one that does
/// not in it alone, so each has its own name.
const READ_STRING_WINDOWS: (&str, &str) = (
    "local read_string_windows = false",
    "local read_string_windows = true",
);

impl Limiter {
    /// The limiter, reading fixed windows' string form too when `read_string_windows`.
    pub fn new(read_string_windows: bool) -> Self {
        let body = if read_string_windows {
            body!().replacen(READ_STRING_WINDOWS.0, READ_STRING_WINDOWS.1, 1)
        } else {
            body!().to_owned()
        };
        let script = redis::Script::new(&format!(concat!("{}", script_end!()), body));
        let name = format!("sluice_{}", &script.get_hash()[..16]);
        let library = format!(
            "#!lua name={name}\n{body}\nredis.register_function{{function_name = '{name}', \
             callback = batches, flags = {{ 'allow-cross-slot-keys' }}}}\n"
        );
        Self {
            name,
            library,
            script,
            scripts_only: AtomicBool::new(false),
            loading: tokio::sync::Mutex::new(()),
        }
    }
}

/// How a call passes its keys to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// As the call's keys (`KEYS`): they share a slot, and a cluster client routes the call by
    /// them (following MOVED and ASK).
    Declared,
    /// After the numbers, none declared: groups of several slots on the cluster master the call
    /// is sent to, whose node checks each access (see `batch.lua`).
    Undeclared,
}

impl Limiter {
    /// Runs `groups` on `conn` in one call: each group's answer, in order.
    pub async fn run(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        groups: &[Group],
        keys: Keys,
    ) -> RedisResult<Vec<GroupAnswer>> {
        let replies = self.call(conn, groups, keys).await?;
        answers(replies, groups)
    }

    async fn call(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        call: &[Group],
        keys: Keys,
    ) -> RedisResult<redis::Value> {
        if !self.scripts_only.load(Ordering::Relaxed) {
            let fcall = self.command("FCALL", &self.name, call, keys);
            match fcall.query_async(conn).await {
                Err(e) if is_missing_function(&e) => match self.load_and_call(conn, &fcall).await {
                    Ok(reply) => return reply,
                    Err(refusal) => self.use_scripts(&refusal),
                },
                // An ACL that allows scripts but not FCALL.
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) => {
                    self.use_scripts(&e)
                }
                other => return other,
            }
        }
        let evalsha = self.command("EVALSHA", self.script.get_hash(), call, keys);
        match evalsha.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                evalsha.query_async(conn).await
            }
            other => other,
        }
    }

    /// `fcall` found no library: loads it and calls again. Calls sent together miss together (a
    /// node's first burst, a server that restarted), so one loads at a time and the others,
    /// when their turn comes, find it loaded and only call again; each load costs Redis ~0.6
    /// ms, and a node's first burst made ~40 of them. Err: the server refuses to load it.
    async fn load_and_call(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        fcall: &redis::Cmd,
    ) -> Result<RedisResult<redis::Value>, RedisError> {
        let _loading = self.loading.lock().await;
        match fcall.query_async(conn).await {
            Err(e) if is_missing_function(&e) => {}
            other => return Ok(other),
        }
        match self.load(conn).await {
            Ok(()) => Ok(fcall.query_async(conn).await),
            Err(e) if is_refusal(&e) => Err(e),
            Err(e) => Ok(Err(e)),
        }
    }

    fn use_scripts(&self, refusal: &RedisError) {
        tracing::warn!(
            error = %refusal,
            "Redis refuses Functions: the limiter runs as a script (EVALSHA) from now on"
        );
        self.scripts_only.store(true, Ordering::Relaxed);
    }

    /// Loads the library (on every master, through a cluster connection). `REPLACE`: the name is
    /// this body's, so what it replaces is the same code; without it, a second loader (another
    /// node, or the same one racing itself) would get an error.
    async fn load(&self, conn: &mut (impl ConnectionLike + Send)) -> RedisResult<()> {
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.library)
            .query_async::<redis::Value>(conn)
            .await
            .map(drop)
    }

    /// `FCALL name` or `EVALSHA sha`, then the same keys and arguments: every group's keys
    /// (declared, or after the rest), the number of groups, the call's time (its groups share
    /// one: see `batcher`), and every group's header (checks, numbers) and numbers, packed into
    /// one argument.
    fn command(&self, verb: &str, name: &str, groups: &[Group], keys: Keys) -> redis::Cmd {
        let every_key = |cmd: &mut redis::Cmd| {
            for key in groups.iter().flat_map(|g| &g.keys) {
                cmd.arg(key.as_slice());
            }
        };
        let mut cmd = redis::cmd(verb);
        cmd.arg(name);
        if keys == Keys::Declared {
            cmd.arg(groups.iter().map(|g| g.keys.len()).sum::<usize>());
            every_key(&mut cmd);
        } else {
            cmd.arg(0);
        }
        let now = groups.first().and_then(|g| g.now);
        debug_assert!(
            groups.iter().all(|g| g.now == now),
            "a call's groups share a time"
        );
        let numbers: usize = groups.iter().map(|g| 2 + g.args.len()).sum();
        let mut packed = Vec::with_capacity(8 * numbers);
        for g in groups {
            for n in [g.keys.len() as u64, g.args.len() as u64]
                .iter()
                .chain(&g.args)
            {
                packed.extend_from_slice(&pack(*n));
            }
        }
        cmd.arg(groups.len());
        match now {
            Some(now) => cmd.arg(now),
            None => cmd.arg(""),
        };
        cmd.arg(packed);
        if keys == Keys::Undeclared {
            every_key(&mut cmd);
        }
        cmd
    }
}

/// A number as `batch.lua` unpacks it: a little-endian double. Every number the limiter
/// sends is an integer below 2^53 (see `limiter`), which a double holds exactly; one past it
/// (a request's hits from the wire) rounds as Lua's `tonumber` of its digits would.
fn pack(n: u64) -> [u8; 8] {
    (n as f64).to_le_bytes()
}

/// A packed number of the reply: an integer in i64's range, or None.
fn unpack(bytes: &[u8]) -> Option<i64> {
    let v = f64::from_le_bytes(bytes.try_into().ok()?);
    // 2^63 is the first double past i64's range.
    (v.fract() == 0.0 && v >= -(2f64.powi(63)) && v < 2f64.powi(63)).then_some(v as i64)
}

/// The call's flat reply (see `batch.lua`): its time, then each group's verdicts (4 integers
/// per check) or the text of its error.
fn answers(reply: redis::Value, groups: &[Group]) -> RedisResult<Vec<GroupAnswer>> {
    let reply = match reply {
        redis::Value::BulkString(packed) => return packed_answers(&packed, groups),
        redis::Value::Array(values) => values,
        other => return Err(unexpected(format!("{other:?} as the limiter's reply"))),
    };
    let mut values = reply.into_iter();
    let now = match values.next() {
        Some(redis::Value::Int(now)) => now,
        other => return Err(unexpected(format!("{other:?} as the call's time"))),
    };
    let mut answers = Vec::with_capacity(groups.len());
    for g in groups {
        let error = match values.as_slice().first() {
            Some(redis::Value::BulkString(text)) => {
                Some(String::from_utf8_lossy(text).into_owned())
            }
            Some(redis::Value::SimpleString(text)) => Some(text.clone()),
            _ => None,
        };
        if let Some(error) = error {
            values.next();
            answers.push(Err(error));
            continue;
        }
        let checks = 4 * g.keys.len();
        let verdicts = values
            .by_ref()
            .take(checks)
            .map(|v| match v {
                redis::Value::Int(n) => Ok(n),
                other => Err(unexpected(format!("{other:?} in a group's verdicts"))),
            })
            .collect::<RedisResult<Vec<i64>>>()?;
        if verdicts.len() != checks {
            return Err(unexpected(format!(
                "{} values for a group of {} checks",
                verdicts.len(),
                g.keys.len()
            )));
        }
        answers.push(Ok((now, verdicts)));
    }
    if values.next().is_some() {
        return Err(unexpected("more values than the groups' checks".into()));
    }
    Ok(answers)
}

/// The reply where no group raised an error: the same numbers, packed (see `pack`).
fn packed_answers(packed: &[u8], groups: &[Group]) -> RedisResult<Vec<GroupAnswer>> {
    let checks: usize = groups.iter().map(|g| g.keys.len()).sum();
    if packed.len() != 8 * (1 + 4 * checks) {
        return Err(unexpected(format!(
            "{} bytes for {} checks",
            packed.len(),
            checks
        )));
    }
    let mut numbers = packed.chunks_exact(8).map(unpack);
    let now = numbers
        .next()
        .flatten()
        .ok_or_else(|| unexpected("a time that is not an integer".into()))?;
    let mut answers = Vec::with_capacity(groups.len());
    for g in groups {
        // Sized up front: collected through an Option, the vector grew from nothing.
        let mut verdicts = Vec::with_capacity(4 * g.keys.len());
        for n in numbers.by_ref().take(4 * g.keys.len()) {
            verdicts.push(n.ok_or_else(|| unexpected("a verdict that is not an integer".into()))?);
        }
        answers.push(Ok((now, verdicts)));
    }
    Ok(answers)
}

fn unexpected(what: String) -> RedisError {
    RedisError::from((ErrorKind::Client, "unexpected reply from the limiter", what))
}

/// A group's error text saying the node does not serve one of its keys (a call of undeclared
/// keys sent to a master that no longer holds, or is still receiving, the key's slot): the
/// group may go again on its slot (see `masters`).
pub fn is_not_served(text: &str) -> bool {
    text.contains("non local key")
}

/// The server answered, and it will not load the library: no such command, or not allowed.
fn is_refusal(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ResponseError | ServerErrorKind::NoPerm)
    )
}

/// The server has no function of this name (it lost its functions, or never had this
/// version's), or no `FCALL` at all (Redis 6). Redis says so only in the message's text.
fn is_missing_function(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && e.detail().is_some_and(|d| {
            d.starts_with("Function not found") || d.starts_with("unknown command")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    /// The library that reads fixed windows' string form is the other in its one line, and
    /// has its own name, so nodes of either kind load and call their own.
    #[test]
    fn reading_the_string_form_is_its_own_library() {
        assert_eq!(LIMITER_SCRIPT.matches(READ_STRING_WINDOWS.0).count(), 1);
        let (plain, strings) = (Limiter::new(false), Limiter::new(true));
        let hash_of = |code: &str| redis::Script::new(code).get_hash().to_owned();
        assert_eq!(plain.script.get_hash(), hash_of(LIMITER_SCRIPT));
        assert_eq!(
            strings.script.get_hash(),
            hash_of(&LIMITER_SCRIPT.replacen(READ_STRING_WINDOWS.0, READ_STRING_WINDOWS.1, 1))
        );
        assert_ne!(plain.name, strings.name);
        assert!(strings.library.contains(&strings.name));
    }

    /// Step 2 of the limiter's checklist: a Lua file not in `body!` never reaches Redis.
    #[test]
    fn every_lua_file_is_in_the_body() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/store/redis/lua");
        let mut files = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "lua") {
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(
                    LIMITER_SCRIPT.contains(&text),
                    "{} is not in body! (src/store/redis/script.rs)",
                    path.display()
                );
                files += 1;
            }
        }
        assert!(files >= 6, "read {files} Lua files from {dir}");
    }

    /// Step 2 of the limiter's checklist: each algorithm id has its functions in `batch.lua`'s
    /// dispatch tables, which Lua indexes by the id.
    #[test]
    fn dispatch_tables_have_an_entry_per_algorithm() {
        let batch = include_str!("lua/batch.lua");
        for table in ["decide_of", "commit_of", "refund_of"] {
            let start = batch
                .find(&format!("local {table} = {{"))
                .unwrap_or_else(|| panic!("batch.lua has no table {table}"));
            let body = &batch[start..];
            let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
            let entries = body.split(',').filter(|e| !e.trim().is_empty()).count();
            assert_eq!(
                entries,
                usize::from(Algorithm::MAX_ID),
                "batch.lua's {table} needs one function per algorithm id, in id order"
            );
        }
        assert_eq!(usize::from(Algorithm::MAX_ID), Algorithm::ALL.len());
    }
}
