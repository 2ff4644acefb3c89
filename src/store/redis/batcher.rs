//! Cross-request batching: the groups of checks that queue while earlier calls are in flight
//! leave together, as one call of the limiter (`batch.lua`'s `batches`).
//!
//! Why: most of what a decision costs Redis is the call around it — reading and parsing the
//! command, starting the function, `TIME`, writing the reply — not the two or three hash
//! commands the check itself runs. One call per request paid that every time (~12 µs of Redis
//! CPU per decision, BENCHMARKS.md); a call carrying the groups that queued meanwhile pays it once
//! for them all. Each group is still its own request: all-or-nothing on its own, answered on its
//! own, its errors its own.
//!
//! How: a group that arrives while no call is out leaves as soon as the runtime has taken two
//! turns (see [`gather`]) with the groups that came with it — no timer, and at low load nothing
//! measurable (p50 251 against 250 µs at 2 000 calls/s, BENCHMARKS.md). One that arrives while
//! a call is out waits in the queue, and when the call comes back the worker sends everything
//! queued (up to `max_groups`) as the next call. So batches grow with the load, by themselves.
//! A further call (up to `in_flight`, one per connection of the pool) leaves while one is out
//! only once a whole call's worth (`max_groups`) is waiting: that is when waiting would cap
//! what the node decides (a distant Redis), and below it, a second call out would only split
//! the queue. Splitting it cost more than it saved: on one core with Redis, two calls out at
//! once (the second leaving as soon as its requests came) made sluice sleep and wake two to
//! three times as often and both processes run colder, 9–28 % more CPU a decision at the same
//! calls per FCALL (BENCHMARKS.md); what a request may wait instead is the rest of one round
//! trip. A group whose caller gave up before it left is dropped unsent.
//!
//! Each group carries its deadline (the request's `--redis-timeout`), and the batcher keeps it:
//! a group whose deadline passed while it queued is answered `Timeout` unsent, and a call is
//! given up at its earliest group's deadline, each of its groups then answered `Timeout`. One
//! timer a call, where a timer per request cost each decision ~670 instructions of its ~51 000
//! (registering it, polling it, taking it down: `scripts/instructions redis`). A group can time
//! out a little before its own deadline, by at most how much earlier the call's first group
//! queued: at most one call's time, since a call leaves with the groups that queued while the
//! call before it was out.
//!
//! As tower's `Buffer::pair`, [`Batcher::pair`] hands the worker back to its caller, which runs
//! it (the store spawns it on first use: a store can be made outside a runtime).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use super::script::{Group, GroupAnswer};

/// Why a call failed, for every group it carried (so it clones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailure {
    /// The client's own response timeout, or the group's deadline passed before its call
    /// came back.
    Timeout,
    /// Anything else, its message with any password hidden.
    Failed(String),
    /// The worker is gone (its runtime shut down).
    Stopped,
}

/// A call of the limiter with these groups: each group's answer, in order (a call that failed
/// fails each of its groups; a cluster's call may reach several servers, and fail on one).
pub type SendCall = Box<dyn Fn(Vec<Group>) -> CallFuture + Send + Sync>;

pub type CallFuture = Pin<Box<dyn Future<Output = Vec<GroupOutcome>> + Send>>;

/// One group's outcome: its answer, or why its call failed.
pub type GroupOutcome = Result<GroupAnswer, CallFailure>;

/// The worker: run it on a runtime until every [`Batcher`] handle is dropped.
pub type Worker = Pin<Box<dyn Future<Output = ()> + Send>>;

struct Pending {
    group: Group,
    answer: oneshot::Sender<GroupOutcome>,
    /// Answered `Timeout` at this instant at the latest.
    deadline: Instant,
}

/// The handle: submits a group and waits for its answer.
pub struct Batcher {
    queue: mpsc::UnboundedSender<Pending>,
    waiting: Arc<Waiting>,
}

/// The groups in the queue, counted apart from it so the worker, while a call is out, is woken
/// only when a whole call's worth waits (not for each group).
struct Waiting {
    count: AtomicUsize,
    full: Notify,
    call_size: usize,
}

impl Batcher {
    /// A handle and its worker, which sends with `send`, at most `in_flight` calls at once (a
    /// second only while a whole call waits) and at most `max_groups` groups per call.
    pub fn pair(send: SendCall, in_flight: usize, max_groups: usize) -> (Self, Worker) {
        let (queue, pending) = mpsc::unbounded_channel();
        let waiting = Arc::new(Waiting {
            count: AtomicUsize::new(0),
            full: Notify::new(),
            call_size: max_groups.max(1),
        });
        let worker = run(pending, waiting.clone(), send, in_flight.max(1));
        (Self { queue, waiting }, Box::pin(worker))
    }

    /// `group`'s answer, from the first call it can leave in, or `Timeout` by `deadline`.
    pub async fn call(&self, group: Group, deadline: Instant) -> GroupOutcome {
        let (answer, answered) = oneshot::channel();
        // Counted before it is sent, so the worker never takes one it has not counted.
        let before = self.waiting.count.fetch_add(1, Ordering::Relaxed);
        let pending = Pending {
            group,
            answer,
            deadline,
        };
        if self.queue.send(pending).is_err() {
            self.waiting.count.fetch_sub(1, Ordering::Relaxed);
            return Err(CallFailure::Stopped);
        }
        if before + 1 == self.waiting.call_size {
            self.waiting.full.notify_one();
        }
        answered.await.unwrap_or(Err(CallFailure::Stopped))
    }
}

/// Lets the requests that arrived alongside a call's first group join it: two turns of the
/// runtime, no timer. A yield runs after the runtime's next poll of its sockets (Tokio defers a
/// yielded task until then), so the first turn reads what the clients sent meanwhile, and the
/// second lets the request tasks that read spawned queue their groups. Without it, a call left
/// with the requests of one poll only: under bench load (64 calls in flight over 4 client
/// connections, sluice and Redis on one core) each call carried 21 requests where it now
/// carries 30, for ~8 % more calls a second on ~10 % less CPU per call (BENCHMARKS.md).
async fn gather() {
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
}

async fn run(
    mut pending: mpsc::UnboundedReceiver<Pending>,
    waiting: Arc<Waiting>,
    send: SendCall,
    in_flight: usize,
) {
    let max_groups = waiting.call_size;
    let mut out = FuturesUnordered::new();
    let mut open = true;
    // A group of another time than the batch before it (pinned clocks, in tests): it starts
    // the next call, since a call's groups share one time (see `batch.lua`).
    let mut held: Option<Pending> = None;
    while open || !out.is_empty() || held.is_some() {
        // A call may leave: none is out, or a whole call waits and another may go out.
        let queued = waiting.count.load(Ordering::Relaxed) + usize::from(held.is_some());
        let room = out.is_empty() || (out.len() < in_flight && queued >= max_groups);
        let first = match held.take() {
            Some(first) if room => first,
            held_back => {
                held = held_back;
                tokio::select! {
                    // Answers first: a call back is what lets the queue leave.
                    biased;
                    Some(()) = out.next(), if !out.is_empty() => continue,
                    first = pending.recv(), if open && held.is_none() && room => {
                        match first {
                            Some(first) => {
                                waiting.count.fetch_sub(1, Ordering::Relaxed);
                                first
                            }
                            None => {
                                open = false;
                                continue;
                            }
                        }
                    }
                    // A whole call's worth queued while one is out: look again.
                    () = waiting.full.notified(), if open && !room && out.len() < in_flight => continue,
                    else => continue,
                }
            }
        };
        gather().await;
        let mut batch = Vec::with_capacity(8);
        batch.push(first);
        while batch.len() < max_groups {
            match pending.try_recv() {
                Ok(p) => {
                    waiting.count.fetch_sub(1, Ordering::Relaxed);
                    if p.group.now != batch[0].group.now {
                        held = Some(p);
                        break;
                    }
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        // Callers that gave up are not sent for, nor groups whose time is up.
        let now = Instant::now();
        batch.retain(|p| !p.answer.is_closed());
        if batch.iter().any(|p| p.deadline <= now) {
            let (late, on_time): (Vec<_>, Vec<_>) =
                batch.into_iter().partition(|p| p.deadline <= now);
            for p in late {
                let _ = p.answer.send(Err(CallFailure::Timeout));
            }
            batch = on_time;
        }
        let Some(deadline) = batch.iter().map(|p| p.deadline).min() else {
            continue;
        };
        let (groups, answers): (Vec<Group>, Vec<_>) =
            batch.into_iter().map(|p| (p.group, p.answer)).unzip();
        let call = tokio::time::timeout_at(deadline, send(groups));
        out.push(async move {
            let mut outcomes = match call.await {
                Ok(outcomes) => outcomes.into_iter(),
                Err(_) => vec![Err(CallFailure::Timeout); answers.len()].into_iter(),
            };
            for answer in answers {
                let outcome = outcomes
                    .next()
                    .unwrap_or_else(|| Err(CallFailure::Failed("no answer for this group".into())));
                let _ = answer.send(outcome);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn group(n: u64) -> Group {
        Group {
            keys: vec![n.to_string().into_bytes()],
            now: None,
            args: vec![n],
            trace: None,
        }
    }

    /// What each call carried (each group's argument), in order.
    type Calls = Arc<Mutex<Vec<Vec<u64>>>>;

    /// A `send` that records each call's groups and answers each group with its own argument
    /// (13 with an error); calls complete only when the test releases them.
    fn recording() -> (SendCall, Calls, Arc<tokio::sync::Semaphore>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let (c, r) = (calls.clone(), release.clone());
        let send: SendCall = Box::new(move |groups: Vec<Group>| {
            let (c, r) = (c.clone(), r.clone());
            Box::pin(async move {
                c.lock()
                    .unwrap()
                    .push(groups.iter().map(|g| g.args[0]).collect());
                r.acquire().await.unwrap().forget();
                groups
                    .iter()
                    .map(|g| {
                        Ok(if g.args[0] == 13 {
                            Err("unlucky".to_owned())
                        } else {
                            Ok((0, vec![g.args[0] as i64]))
                        })
                    })
                    .collect()
            })
        });
        (send, calls, release)
    }

    fn spawn_call(batcher: &Arc<Batcher>, group: Group) -> tokio::task::JoinHandle<GroupOutcome> {
        let batcher = batcher.clone();
        tokio::spawn(async move { batcher.call(group, far()).await })
    }

    /// A deadline no test reaches.
    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(3600)
    }

    /// Queues `groups` before the worker runs, then runs it and lets every call answer: each
    /// group's outcome, in order.
    async fn queued_then_run(
        batcher: Batcher,
        worker: Worker,
        release: &tokio::sync::Semaphore,
        groups: Vec<Group>,
    ) -> Vec<GroupOutcome> {
        let batcher = Arc::new(batcher);
        let calls: Vec<_> = groups
            .into_iter()
            .map(|g| spawn_call(&batcher, g))
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tokio::spawn(worker);
        release.add_permits(calls.len());
        let mut outcomes = Vec::new();
        for c in calls {
            outcomes.push(c.await.unwrap());
        }
        outcomes
    }

    /// A running batcher on a recording `send`, one call in flight at most.
    fn running_one_at_a_time() -> (Arc<Batcher>, Calls, Arc<tokio::sync::Semaphore>) {
        let (send, calls, release) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 64);
        tokio::spawn(worker);
        (Arc::new(batcher), calls, release)
    }

    #[tokio::test]
    async fn a_lone_group_leaves_alone_and_the_queue_leaves_together() {
        let (batcher, calls, release) = running_one_at_a_time();
        let first = spawn_call(&batcher, group(1));
        // The first call is out (recorded) before any other group exists.
        while calls.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = (2..=14).map(|n| spawn_call(&batcher, group(n))).collect();
        // Let them all queue behind the call in flight, then answer it.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        release.add_permits(2);
        assert_eq!(first.await.unwrap(), Ok(Ok((0, vec![1]))));
        let mut answers = Vec::new();
        for r in rest {
            answers.push(r.await.unwrap());
        }
        assert_eq!(
            *calls.lock().unwrap(),
            [vec![1], (2..=14).collect::<Vec<_>>()],
            "one call alone, then one call for everything that queued"
        );
        // Each group is answered on its own, its error its own.
        for (n, a) in (2..=14).zip(answers) {
            let want = if n == 13 {
                Ok(Err("unlucky".to_owned()))
            } else {
                Ok(Ok((0, vec![n as i64])))
            };
            assert_eq!(a, want, "group {n}");
        }
    }

    #[tokio::test]
    async fn a_group_that_arrives_while_the_first_gathers_leaves_with_it() {
        let (batcher, calls, release) = running_one_at_a_time();
        let first = spawn_call(&batcher, group(1));
        // The first group is with the worker, which is gathering: no call has left.
        tokio::task::yield_now().await;
        assert!(calls.lock().unwrap().is_empty());
        let second = spawn_call(&batcher, group(2));
        release.add_permits(1);
        assert_eq!(first.await.unwrap(), Ok(Ok((0, vec![1]))));
        assert_eq!(second.await.unwrap(), Ok(Ok((0, vec![2]))));
        assert_eq!(*calls.lock().unwrap(), [vec![1, 2]], "one call for both");
    }

    #[tokio::test]
    async fn a_failed_call_fails_each_of_its_groups_and_a_caller_that_left_is_not_sent() {
        let send: SendCall = Box::new(|groups| {
            Box::pin(async move { vec![Err(CallFailure::Timeout); groups.len()] })
        });
        let (batcher, worker) = Batcher::pair(send, 2, 64);
        tokio::spawn(worker);
        assert_eq!(
            batcher.call(group(1), far()).await,
            Err(CallFailure::Timeout)
        );

        let (send, calls, release) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 64);
        let batcher = Arc::new(batcher);
        // Queued before the worker runs, so they leave in one call: all but the group whose
        // caller gave up.
        let gone = spawn_call(&batcher, group(7));
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        let kept = spawn_call(&batcher, group(8));
        tokio::task::yield_now().await;
        tokio::spawn(worker);
        release.add_permits(1);
        assert_eq!(kept.await.unwrap(), Ok(Ok((0, vec![8]))));
        assert_eq!(*calls.lock().unwrap(), [vec![8]]);
        // Every handle gone: the worker ends; a handle whose worker is gone says so.
        drop(batcher);
        let (send, _, _) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 64);
        drop(worker);
        assert_eq!(
            batcher.call(group(1), far()).await,
            Err(CallFailure::Stopped)
        );
    }

    #[tokio::test]
    async fn a_second_call_leaves_only_for_a_whole_calls_worth() {
        let (send, calls, release) = recording();
        let (batcher, worker) = Batcher::pair(send, 2, 4);
        tokio::spawn(worker);
        let batcher = Arc::new(batcher);
        let first = spawn_call(&batcher, group(1));
        while calls.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        // Three queue while the first call is out: fewer than a call's worth, so they wait for
        // it although a second call may be out.
        let mut rest: Vec<_> = (2..=4).map(|n| spawn_call(&batcher, group(n))).collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*calls.lock().unwrap(), [vec![1]], "the three wait");
        // A fourth makes a whole call: it leaves with them, the first still out.
        rest.push(spawn_call(&batcher, group(5)));
        while calls.lock().unwrap().len() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*calls.lock().unwrap(), [vec![1], vec![2, 3, 4, 5]]);
        // Two out, the most: a further whole call waits for one to come back.
        let more: Vec<_> = (6..=9).map(|n| spawn_call(&batcher, group(n))).collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(calls.lock().unwrap().len(), 2, "at most two calls out");
        release.add_permits(3);
        assert_eq!(first.await.unwrap(), Ok(Ok((0, vec![1]))));
        for (n, r) in (2..=9).zip(rest.into_iter().chain(more)) {
            assert_eq!(r.await.unwrap(), Ok(Ok((0, vec![n]))), "group {n}");
        }
        assert_eq!(
            *calls.lock().unwrap(),
            [vec![1], vec![2, 3, 4, 5], vec![6, 7, 8, 9]]
        );
    }

    #[tokio::test]
    async fn a_call_carries_groups_of_one_time() {
        let (send, calls, release) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 64);
        let groups = [(1, 5), (2, 5), (3, 6), (4, 6), (5, 5)].map(|(n, now)| Group {
            now: Some(now),
            ..group(n)
        });
        for outcome in queued_then_run(batcher, worker, &release, groups.to_vec()).await {
            assert!(outcome.is_ok());
        }
        assert_eq!(*calls.lock().unwrap(), [vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[tokio::test]
    async fn a_call_carries_at_most_max_groups() {
        let (send, calls, release) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 4);
        for outcome in
            queued_then_run(batcher, worker, &release, (1..=10).map(group).collect()).await
        {
            assert!(outcome.is_ok());
        }
        let sizes: Vec<usize> = calls.lock().unwrap().iter().map(Vec::len).collect();
        assert_eq!(sizes, [4, 4, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_out_past_its_groups_deadline_answers_them_timeout() {
        let (send, calls, _release) = recording();
        let (batcher, worker) = Batcher::pair(send, 1, 64);
        tokio::spawn(worker);
        let start = Instant::now();
        let deadline = start + std::time::Duration::from_millis(50);
        // The call never comes back: its group is answered at its deadline, not later.
        assert_eq!(
            batcher.call(group(1), deadline).await,
            Err(CallFailure::Timeout)
        );
        assert_eq!(Instant::now(), deadline);
        assert_eq!(*calls.lock().unwrap(), [vec![1]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_whose_deadline_passed_in_the_queue_is_not_sent() {
        let (batcher, calls, release) = running_one_at_a_time();
        let first = spawn_call(&batcher, group(1));
        while calls.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let deadline = Instant::now() + std::time::Duration::from_millis(20);
        let queued = {
            let batcher = batcher.clone();
            tokio::spawn(async move { batcher.call(group(2), deadline).await })
        };
        let fresh = spawn_call(&batcher, group(3));
        // The first call comes back after the queued group's deadline.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        release.add_permits(2);
        assert_eq!(first.await.unwrap(), Ok(Ok((0, vec![1]))));
        assert_eq!(queued.await.unwrap(), Err(CallFailure::Timeout));
        assert_eq!(fresh.await.unwrap(), Ok(Ok((0, vec![3]))));
        assert_eq!(*calls.lock().unwrap(), [vec![1], vec![3]], "2 is not sent");
    }
}
