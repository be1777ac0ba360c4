//! Tiny scenario tests of one shard through one `check` helper with the expected trace inline
//! (rust-analyzer style). Every step is followed by `check_invariants`.
//!
//! Script lines:
//!   tenant ID [weight=W] [lane=LANE] [running=N] [queued=N] [rate=PER_MIN/BURST] [classes=std|all] [overflow=be]
//!   lane LANE capacity=U | lane LANE closed
//!   provider ID concurrency=N
//!   aging step_ms=N skips=N fit_scan=N
//!   reserve borrow=U headroom=U (enterprise borrowing is off unless given)
//!   drr quantum=U
//!   build                      (freezes the policy; implicit before the first other command)
//!   submit TASK tenant=T [user=U] [res=720p|1080p|4k] [dur=S] [band=Pn] [audio] [deadline=MS]
//!   restore TASK tenant=T [lane=LANE] [band=Pn] [attempts=N] …   (put back from PostgreSQL: no admission)
//!   resume TASK tenant=T state=running|unknown|queued [provider=P] [attempt=N] …
//!                              (a live attempt put back: its provider stage held again)
//!   tick MS                    (advance the clock)
//!   dispatch [noaccept]        (drain poll_dispatch; grants claims; providers accept)
//!   accept TASK
//!   done TASK [actual=U]       (provider succeeded, media runs and finishes)
//!   fail TASK ratelimited|retryable|fatal
//!   unknown TASK / notfound TASK / stale TASK / cancel TASK
//!   suspend T on|off           (an operator suspends tenant T, or resumes it: its policy, live)

use std::collections::HashMap;
use std::fmt::Write;

use expect_test::{expect, Expect};
use spindle_core::presets::{self, tenant};
use spindle_core::shard::{Failure, Poll, RestoreRequest, ResumeRequest, SubmitRequest};
use spindle_core::{
    Band, FencingToken, Lane, ModelId, Policy, Shard, TaskId, TaskSpec, TenantId, Time, Units,
    UserId,
};

struct Harness {
    policy: Policy,
    shard: Option<Shard>,
    now: Time,
    tokens: HashMap<TaskId, FencingToken>,
    next_token: u64,
    out: String,
}

fn lane_of(name: &str) -> Lane {
    Lane::ALL
        .into_iter()
        .find(|l| l.name() == name)
        .unwrap_or_else(|| panic!("lane {name}"))
}

fn kv<'a>(args: &'a [&'a str], key: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

impl Harness {
    fn shard(&mut self) -> &mut Shard {
        if self.shard.is_none() {
            self.shard = Some(Shard::new(self.policy.clone(), 1, Time::ZERO));
        }
        self.shard.as_mut().unwrap()
    }

    fn configure(&mut self, cmd: &str, args: &[&str]) {
        assert!(
            self.shard.is_none(),
            "configuration after the shard was built"
        );
        match cmd {
            "tenant" => {
                let id = TenantId(args[0].parse().unwrap());
                let lane = kv(args, "lane").map_or(Lane::Standard, lane_of);
                let weight = kv(args, "weight").map_or(1, |w| w.parse().unwrap());
                let mut t = tenant(lane, weight);
                if let Some(n) = kv(args, "running") {
                    t.running_tasks_max = n.parse().unwrap();
                }
                if let Some(n) = kv(args, "queued") {
                    t.queued_tasks_max = n.parse().unwrap();
                }
                if let Some(r) = kv(args, "rate") {
                    let (per_minute, burst) = r.split_once('/').unwrap();
                    t.submit_rate.per_minute = per_minute.parse().unwrap();
                    t.submit_rate.burst = burst.parse().unwrap();
                }
                if kv(args, "classes") == Some("std") {
                    t.allowed_classes = vec![spindle_core::ResourceClass::Standard];
                }
                if kv(args, "overflow") == Some("be") {
                    t.wait_overflow = spindle_core::policy::WaitOverflow::BestEffort;
                    t.max_wait_ms = 1_000;
                }
                self.policy.tenants.insert(id, t);
            }
            "lane" => {
                let l = &mut self.policy.lanes[lane_of(args[0]).index()];
                if args[1] == "closed" {
                    l.open = false;
                } else {
                    l.capacity = Units::whole(kv(args, "capacity").unwrap().parse().unwrap());
                }
            }
            "provider" => {
                let p = &mut self.policy.providers[args[0].parse::<usize>().unwrap()];
                p.concurrency = kv(args, "concurrency").unwrap().parse().unwrap();
            }
            "aging" => {
                let a = &mut self.policy.aging;
                a.aging_step_ms =
                    kv(args, "step_ms").map_or(a.aging_step_ms, |v| v.parse().unwrap());
                a.skips_max = kv(args, "skips").map_or(a.skips_max, |v| v.parse().unwrap());
                a.fit_scan_max =
                    kv(args, "fit_scan").map_or(a.fit_scan_max, |v| v.parse().unwrap());
            }
            "reserve" => {
                let r = &mut self.policy.reserve;
                r.borrow_limit = Units::whole(kv(args, "borrow").unwrap().parse().unwrap());
                r.minimum_reserved_headroom =
                    Units::whole(kv(args, "headroom").unwrap().parse().unwrap());
            }
            "drr" => {
                self.policy.drr.base_quantum =
                    Units::whole(kv(args, "quantum").unwrap().parse().unwrap());
            }
            _ => unreachable!(),
        }
    }

    fn submit(&mut self, args: &[&str], how: &str) {
        let task = TaskId(args[0].trim_start_matches('t').parse().unwrap());
        let tenant = TenantId(kv(args, "tenant").unwrap().parse().unwrap());
        let user = UserId(kv(args, "user").map_or(tenant.0 * 100, |u| u.parse().unwrap()));
        let (width, height) = match kv(args, "res").unwrap_or("720p") {
            "720p" => (1280, 720),
            "1080p" => (1920, 1080),
            "4k" => (3840, 2160),
            other => panic!("res {other}"),
        };
        let duration_ms = kv(args, "dur").map_or(5, |d| d.parse::<u32>().unwrap()) * 1000;
        let spec = TaskSpec {
            model: ModelId(0),
            width,
            height,
            duration_ms,
            fps: 24,
            audio: args.contains(&"audio"),
            references: 0,
        };
        let band_hint = kv(args, "band").map(|b| Band::from_index(b[1..].parse().unwrap()));
        let deadline = kv(args, "deadline").map(|ms| Time::from_ms(ms.parse().unwrap()));
        let now = self.now;
        let req = SubmitRequest {
            task,
            tenant,
            user,
            spec,
            band_hint,
            deadline,
        };
        if how == "resume" {
            self.next_token += 1;
            let token = FencingToken(self.next_token);
            let state = match kv(args, "state").unwrap() {
                "running" => spindle_core::TaskState::Running,
                "unknown" => spindle_core::TaskState::SubmitUnknown,
                "queued" => spindle_core::TaskState::Queued,
                other => panic!("state {other}"),
            };
            let resume = ResumeRequest {
                submit: req,
                lane: kv(args, "lane").map_or(Lane::Standard, lane_of),
                band: band_hint.unwrap_or(Band::P3),
                attempt_no: kv(args, "attempt").map_or(1, |a| a.parse().unwrap()),
                provider: spindle_core::ProviderId(
                    kv(args, "provider").map_or(0, |p| p.parse().unwrap()),
                ),
                token,
                state,
            };
            let r = self.shard().handle_resume(now, resume).map(|_| ());
            if r.is_ok() {
                self.tokens.insert(task, token);
            }
            let state = self.shard().task_state(task);
            writeln!(self.out, "resume {task}: {r:?} state={state:?}").unwrap();
            return;
        }
        if how == "restore" {
            let restore = RestoreRequest {
                submit: req,
                lane: kv(args, "lane").map_or(Lane::Standard, lane_of),
                band: band_hint.unwrap_or(Band::P3),
                attempts_before: kv(args, "attempts").map_or(1, |a| a.parse().unwrap()),
            };
            let r = self.shard().handle_restore(now, restore);
            writeln!(self.out, "restore {task}: {r:?}").unwrap();
            return;
        }
        let line = match self.shard().handle_submit(now, req) {
            Ok(a) if a.decision.is_accepted() => format!(
                "{task}: {} lane={} band={} fairness={} level={:?}",
                a.decision,
                a.lane,
                a.band,
                a.estimate.fairness,
                a.queue_level.unwrap()
            ),
            Ok(a) => format!("{task}: {} ({})", a.decision, a.reason.unwrap()),
            Err(e) => format!("{task}: error: {e}"),
        };
        writeln!(self.out, "{line}").unwrap();
    }

    fn dispatch(&mut self, accept: bool) {
        let now = self.now;
        loop {
            match self.shard().poll_dispatch(now) {
                Poll::Dispatch(d) => {
                    self.next_token += 1;
                    let token = FencingToken(self.next_token);
                    self.tokens.insert(d.task, token);
                    let outcome = self.shard().handle_claim_granted(d.task, token).unwrap();
                    if accept && outcome == spindle_core::ClaimOutcome::Submit {
                        self.shard()
                            .handle_provider_accepted(d.task, token)
                            .unwrap();
                    }
                    writeln!(
                        self.out,
                        "dispatch {} tenant={} lane={} provider={} mode={:?} attempt={}",
                        d.task, d.tenant, d.lane, d.provider, d.mode, d.attempt_no
                    )
                    .unwrap();
                }
                Poll::Expired(t) => writeln!(self.out, "expired {t}").unwrap(),
                Poll::Yield => continue,
                Poll::Idle => break,
            }
            self.shard().check_invariants();
        }
    }

    fn task_arg(arg: &str) -> TaskId {
        TaskId(arg.trim_start_matches('t').parse().unwrap())
    }

    fn run(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&cmd, args)) = words.split_first() else {
            return;
        };
        let now = self.now;
        match cmd {
            "tenant" | "lane" | "provider" | "aging" | "reserve" | "drr" => {
                return self.configure(cmd, args)
            }
            "build" => {
                self.shard();
            }
            "submit" | "restore" | "resume" => self.submit(args, cmd),
            "tick" => {
                self.now = self
                    .now
                    .plus_ns(args[0].parse::<u64>().unwrap() * 1_000_000)
            }
            "dispatch" => self.dispatch(args.first() != Some(&"noaccept")),
            "pick" => {
                // One scheduling decision whose claim stays outstanding (not granted).
                let line = match self.shard().poll_dispatch(now) {
                    Poll::Dispatch(d) => format!("picked {} attempt={}", d.task, d.attempt_no),
                    other => format!("pick: {other:?}"),
                };
                writeln!(self.out, "{line}").unwrap();
            }
            "refuse" => {
                let task = Self::task_arg(args[0]);
                let ms: u64 = kv(args, "for").map_or(0, |v| v.parse().unwrap());
                let until = now.plus_ns(ms * 1_000_000);
                let r = self.shard().handle_claim_refused_until(task, until);
                writeln!(self.out, "refuse {task} for {ms} ms: {r:?}").unwrap();
            }
            "accept" => {
                let task = Self::task_arg(args[0]);
                let token = self.tokens[&task];
                let r = self.shard().handle_provider_accepted(task, token);
                writeln!(self.out, "accept {task}: {r:?}").unwrap();
            }
            "done" => {
                let task = Self::task_arg(args[0]);
                let token = self.tokens[&task];
                let actual = kv(args, "actual").map(|u| Units::whole(u.parse().unwrap()));
                let est = self.shard().task_state(task);
                let actual = actual.unwrap_or(Units::whole(1));
                let r = self
                    .shard()
                    .handle_provider_succeeded(now, task, token, actual);
                let mut line = format!("done {task} (was {est:?}): {r:?}");
                if r.is_ok() {
                    while let Some(m) = self.shard().poll_media(now) {
                        let t = self.tokens[&m.task];
                        let outcome = self.shard().handle_media_done(m.task, t, true).unwrap();
                        write!(line, "; media {} {outcome:?}", m.task).unwrap();
                    }
                }
                writeln!(self.out, "{line}").unwrap();
            }
            "fail" => {
                let task = Self::task_arg(args[0]);
                let failure = match args[1] {
                    "ratelimited" => Failure::RateLimited,
                    "retryable" => Failure::Retryable,
                    "fatal" => Failure::NonRetryable,
                    other => panic!("failure {other}"),
                };
                let token = self.tokens[&task];
                let r = self
                    .shard()
                    .handle_provider_failed(now, task, token, failure, 1000);
                writeln!(self.out, "fail {task}: {r:?}").unwrap();
            }
            "unknown" => {
                let task = Self::task_arg(args[0]);
                let token = self.tokens[&task];
                let r = self.shard().handle_submit_unknown(task, token);
                let state = self.shard().task_state(task);
                writeln!(self.out, "unknown {task}: {r:?} state={state:?}").unwrap();
            }
            "notfound" => {
                let task = Self::task_arg(args[0]);
                let token = self.tokens[&task];
                let r = self.shard().handle_provider_not_found(now, task, token);
                writeln!(self.out, "notfound {task}: {r:?}").unwrap();
            }
            "stale" => {
                let task = Self::task_arg(args[0]);
                let r =
                    self.shard()
                        .handle_provider_succeeded(now, task, FencingToken(0), Units(1));
                writeln!(self.out, "stale {task}: {}", r.unwrap_err()).unwrap();
            }
            "cancel" => {
                let task = Self::task_arg(args[0]);
                let r = self.shard().handle_cancel(task);
                writeln!(self.out, "cancel {task}: {r:?}").unwrap();
            }
            "suspend" => {
                let t = TenantId(args[0].parse().unwrap());
                let mut policy = self.shard().policy().tenants[&t].clone();
                policy.suspended = args[1] == "on";
                self.shard().set_tenant_policy(t, policy, now);
            }
            other => panic!("unknown command {other}"),
        }
        self.shard().check_invariants();
    }
}

fn check(script: &str, expected: Expect) {
    let mut policy = presets::small_node();
    policy.reserve.borrow_limit = Units::ZERO;
    let mut h = Harness {
        policy,
        shard: None,
        now: Time::ZERO,
        tokens: HashMap::new(),
        next_token: 0,
        out: String::new(),
    };
    for line in script.lines() {
        h.run(line.trim());
    }
    expected.assert_eq(&h.out);
}

#[test]
fn submit_dispatch_complete() {
    check(
        "
        tenant 1
        submit t1 tenant=1
        dispatch
        done t1
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
        "#]],
    );
}

#[test]
fn drr_alternates_equal_tenants_by_cost_not_count() {
    // Quantum 5 units. Tenant 1 sends 4.8-unit tasks (1080p, 16 s), tenant 2 1-unit tasks: with
    // equal weights one big task alternates with about five small ones.
    check(
        "
        drr quantum=5
        tenant 1
        tenant 2
        submit t1 tenant=1 res=1080p dur=16
        submit t2 tenant=1 res=1080p dur=16
        submit t3 tenant=1 res=1080p dur=16
        submit t11 tenant=2
        submit t12 tenant=2
        submit t13 tenant=2
        submit t14 tenant=2
        submit t15 tenant=2
        submit t16 tenant=2
        submit t17 tenant=2
        submit t18 tenant=2
        submit t19 tenant=2
        submit t20 tenant=2
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=4.800u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=4.800u level=Short
            3: ACCEPTED lane=STANDARD band=P3 fairness=4.800u level=Short
            11: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            12: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            13: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            14: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            15: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            16: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            17: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            18: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            19: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            20: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 11 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 12 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 13 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 14 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 15 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 16 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 17 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 18 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 19 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 20 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn rejections_name_their_reason() {
    check(
        "
        tenant 1 queued=1
        tenant 2 rate=60/1
        tenant 3 classes=std
        lane PAID_SHARED closed
        tenant 4 lane=PAID_SHARED
        submit t1 tenant=1
        submit t2 tenant=1
        submit t3 tenant=2
        submit t4 tenant=2
        submit t5 tenant=3 res=4k
        submit t6 tenant=4
        submit t7 tenant=9
        submit t8 tenant=1 res=720p dur=0
        submit t1 tenant=1
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: REJECT_TENANT_QUEUE_FULL (limit tenant:1:queued_tasks is full)
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            4: REJECT_USER_RATE_LIMIT (limit tenant:2:submit_rate is full)
            5: REJECT_RESOURCE_CLASS_DISABLED (resource class Expensive is not enabled for this tenant)
            6: REJECT_RESOURCE_CLASS_DISABLED (lane PAID_SHARED is closed to new work)
            7: error: tenant 9 has no policy
            8: error: invalid task spec: field `duration_ms` must be greater than zero
            1: error: task 1 is already known to this shard
        "#]],
    );
}

#[test]
fn expected_wait_overflows_to_best_effort() {
    // The lane's initial service rate is 1 unit/s; 3 queued units mean a 3 s wait > 1 s max.
    check(
        "
        lane BEST_EFFORT capacity=2
        tenant 1 overflow=be
        submit t1 tenant=1
        submit t2 tenant=1
        submit t3 tenant=1
        submit t4 tenant=1
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: ACCEPTED_BEST_EFFORT lane=BEST_EFFORT band=P3 fairness=1.000u level=Immediate
            4: ACCEPTED_BEST_EFFORT lane=BEST_EFFORT band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 3 tenant=1 lane=BEST_EFFORT provider=0 mode=Normal attempt=1
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 4 tenant=1 lane=BEST_EFFORT provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn enterprise_reserve_is_borrowed_with_headroom_and_borrowing_stops_when_demand_returns() {
    // Standard has 2 slots; enterprise 10 with 5 headroom and a 10-slot borrow limit: standard
    // borrows 5. Enterprise then queues 6 tasks: 5 fit, one waits. A borrowed task ending frees a
    // slot: it goes to the waiting enterprise task, not to new standard work (no new borrowing
    // while enterprise waits), and no borrowed task is pre-empted.
    check(
        "
        lane STANDARD capacity=2
        lane ENTERPRISE_RESERVED capacity=10
        reserve borrow=10 headroom=5
        tenant 1
        tenant 2 lane=ENTERPRISE_RESERVED
        submit t1 tenant=1
        submit t2 tenant=1
        submit t3 tenant=1
        submit t4 tenant=1
        submit t5 tenant=1
        submit t6 tenant=1
        submit t7 tenant=1
        submit t8 tenant=1
        dispatch
        submit t20 tenant=2
        submit t21 tenant=2
        submit t22 tenant=2
        submit t23 tenant=2
        submit t24 tenant=2
        submit t25 tenant=2
        dispatch
        done t3
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            4: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            5: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            6: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            7: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            8: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Borrowed(EnterpriseReserved) attempt=1
            dispatch 4 tenant=1 lane=STANDARD provider=0 mode=Borrowed(EnterpriseReserved) attempt=1
            dispatch 5 tenant=1 lane=STANDARD provider=0 mode=Borrowed(EnterpriseReserved) attempt=1
            dispatch 6 tenant=1 lane=STANDARD provider=0 mode=Borrowed(EnterpriseReserved) attempt=1
            dispatch 7 tenant=1 lane=STANDARD provider=0 mode=Borrowed(EnterpriseReserved) attempt=1
            20: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Immediate
            21: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Short
            22: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Short
            23: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Short
            24: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Short
            25: ACCEPTED lane=ENTERPRISE_RESERVED band=P1 fairness=1.000u level=Short
            dispatch 20 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
            dispatch 21 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
            dispatch 22 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
            dispatch 23 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
            dispatch 24 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
            done 3 (was Some(Running)): Ok(AwaitingMedia); media 3 Succeeded
            dispatch 25 tenant=2 lane=ENTERPRISE_RESERVED provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn big_head_is_skipped_at_most_skips_max_times() {
    // Quantum 5: after two small tasks the 4.8-unit head lacks credit; the fit-scan runs small
    // tasks past it twice (skips=2), then the tenant stops skipping, its turn ends, and with the
    // next quantum the head runs before the remaining small task.
    check(
        "
        drr quantum=5
        aging skips=2
        tenant 1
        submit t1 tenant=1
        submit t2 tenant=1
        submit t3 tenant=1 res=1080p dur=16
        submit t4 tenant=1
        submit t5 tenant=1
        submit t6 tenant=1
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: ACCEPTED lane=STANDARD band=P3 fairness=4.800u level=Short
            4: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            5: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            6: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 4 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 5 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 6 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn aging_lifts_a_waiting_low_band_task_past_newer_higher_band_work() {
    // Step 1 s. At 2 s the P4 task has aged two bands (P2) and beats the fresh P3 task; without
    // aging P3 would always go first. Then the next P3 (older) beats a P3 that came later.
    check(
        "
        lane STANDARD capacity=1
        aging step_ms=1000
        tenant 1
        submit t1 tenant=1
        dispatch
        submit t2 tenant=1 band=P4
        tick 1500
        submit t3 tenant=1
        tick 500
        submit t4 tenant=1
        done t1
        dispatch
        done t2
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            2: ACCEPTED lane=STANDARD band=P4 fairness=1.000u level=Immediate
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            4: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            done 2 (was Some(Running)): Ok(AwaitingMedia); media 2 Succeeded
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn rate_limit_releases_and_requeues_with_backoff_timeout_keeps_reservation() {
    // One slot. A rate-limit answer frees it and delays t1 by the backoff (1 s × jitter 1.0);
    // a timeout keeps the slot (SUBMIT_UNKNOWN) so t1 stays blocked until the provider says
    // "not found"; a rate-limit claim after acceptance is refused; stale tokens change nothing.
    check(
        "
        lane STANDARD capacity=1
        tenant 1
        submit t1 tenant=1
        submit t2 tenant=1
        dispatch noaccept
        fail t1 ratelimited
        dispatch noaccept
        unknown t2
        tick 1000
        dispatch
        notfound t2
        dispatch
        fail t2 ratelimited
        fail t2 retryable
        dispatch
        stale t1
        fail t1 fatal
        cancel t2
        submit t3 tenant=1
        dispatch
        cancel t3
        done t3
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            fail 1: Ok(Requeued { eligible_at: Time(1000000000) })
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            unknown 2: Ok(()) state=Some(SubmitUnknown)
            notfound 2: Ok(Requeued { eligible_at: Time(1000000000) })
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=2
            fail 2: Err(Transition { task: TaskId(2), error: Illegal { from: Running, to: Queued } })
            fail 2: Ok(Requeued { eligible_at: Time(2000000000) })
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=2
            stale 1: task 1: fencing token 0 is stale (current Some(FencingToken(4))); nothing changed
            fail 1: Ok(Failed)
            cancel 2: Ok(Canceled)
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            cancel 3: Ok(CanceledPendingRelease)
            done 3 (was Some(Canceled)): Ok(Canceled)
        "#]],
    );
}

#[test]
fn cancel_of_queued_and_deadline_expiry() {
    check(
        "
        lane STANDARD capacity=1
        tenant 1
        submit t1 tenant=1
        submit t2 tenant=1 deadline=100
        submit t3 tenant=1
        cancel t3
        dispatch
        tick 200
        done t1
        dispatch
        cancel t3
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            cancel 3: Ok(Canceled)
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
            expired 2
            cancel 3: Err(UnknownTask(TaskId(3)))
        "#]],
    );
}

/// A deadline holds wherever the task waits: behind another task of its tenant, while
/// nothing can be dispatched (the lane's one unit is taken), it is expired at its deadline.
#[test]
fn a_deadline_expires_a_task_behind_others_while_nothing_can_start() {
    check(
        "
        lane STANDARD capacity=1
        tenant 1
        submit t1 tenant=1
        dispatch
        submit t2 tenant=1
        submit t3 tenant=1 deadline=100
        tick 200
        dispatch
        cancel t3
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            expired 3
            cancel 3: Err(UnknownTask(TaskId(3)))
        "#]],
    );
}

#[test]
fn fairness_debt_from_underestimated_work_is_paid_out_of_later_quanta() {
    // Quantum 5, 10 slots. Tenant 1's first two tasks cost 5 units each instead of 1: a debt of
    // 8 (4 each, under the 10-unit cap). Its second quantum was granted before the debt was
    // known; the third is spent on the debt, so in the third round tenant 2 goes first and
    // tenant 1 runs again only once tenant 2 has nothing left (work-conserving when alone).
    check(
        "
        drr quantum=5
        lane STANDARD capacity=10
        tenant 1
        tenant 2
        submit t1 tenant=1
        submit t2 tenant=1
        submit t3 tenant=1
        submit t4 tenant=1
        submit t5 tenant=1
        submit t6 tenant=1
        submit t7 tenant=1
        submit t8 tenant=1
        submit t9 tenant=1
        submit t10 tenant=1
        submit t11 tenant=1
        submit t12 tenant=1
        submit t13 tenant=1
        submit t14 tenant=1
        submit t15 tenant=1
        submit t21 tenant=2
        submit t22 tenant=2
        submit t23 tenant=2
        submit t24 tenant=2
        submit t25 tenant=2
        submit t26 tenant=2
        submit t27 tenant=2
        submit t28 tenant=2
        submit t29 tenant=2
        submit t30 tenant=2
        submit t31 tenant=2
        submit t32 tenant=2
        submit t33 tenant=2
        submit t34 tenant=2
        submit t35 tenant=2
        dispatch
        done t1 actual=5
        done t2 actual=5
        done t3
        done t4
        done t5
        done t21
        done t22
        done t23
        done t24
        done t25
        dispatch
        done t6
        done t7
        done t8
        done t9
        done t10
        done t26
        done t27
        done t28
        done t29
        done t30
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            4: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            5: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            6: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            7: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            8: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            9: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            10: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            11: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            12: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            13: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            14: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            15: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            21: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            22: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            23: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            24: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            25: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            26: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            27: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            28: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            29: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            30: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            31: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            32: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            33: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            34: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            35: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 4 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 5 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 21 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 22 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 23 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 24 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 25 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
            done 2 (was Some(Running)): Ok(AwaitingMedia); media 2 Succeeded
            done 3 (was Some(Running)): Ok(AwaitingMedia); media 3 Succeeded
            done 4 (was Some(Running)): Ok(AwaitingMedia); media 4 Succeeded
            done 5 (was Some(Running)): Ok(AwaitingMedia); media 5 Succeeded
            done 21 (was Some(Running)): Ok(AwaitingMedia); media 21 Succeeded
            done 22 (was Some(Running)): Ok(AwaitingMedia); media 22 Succeeded
            done 23 (was Some(Running)): Ok(AwaitingMedia); media 23 Succeeded
            done 24 (was Some(Running)): Ok(AwaitingMedia); media 24 Succeeded
            done 25 (was Some(Running)): Ok(AwaitingMedia); media 25 Succeeded
            dispatch 6 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 7 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 8 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 9 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 10 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 26 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 27 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 28 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 29 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 30 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            done 6 (was Some(Running)): Ok(AwaitingMedia); media 6 Succeeded
            done 7 (was Some(Running)): Ok(AwaitingMedia); media 7 Succeeded
            done 8 (was Some(Running)): Ok(AwaitingMedia); media 8 Succeeded
            done 9 (was Some(Running)): Ok(AwaitingMedia); media 9 Succeeded
            done 10 (was Some(Running)): Ok(AwaitingMedia); media 10 Succeeded
            done 26 (was Some(Running)): Ok(AwaitingMedia); media 26 Succeeded
            done 27 (was Some(Running)): Ok(AwaitingMedia); media 27 Succeeded
            done 28 (was Some(Running)): Ok(AwaitingMedia); media 28 Succeeded
            done 29 (was Some(Running)): Ok(AwaitingMedia); media 29 Succeeded
            done 30 (was Some(Running)): Ok(AwaitingMedia); media 30 Succeeded
            dispatch 31 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 32 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 33 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 34 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 35 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 11 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 12 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 13 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 14 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 15 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn a_claim_refused_until_later_waits_then_runs_on_the_same_attempt() {
    check(
        "
        tenant 1
        submit t1 tenant=1
        pick
        refuse t1 for=1000
        pick
        tick 999
        pick
        tick 1
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            picked 1 attempt=1
            refuse 1 for 1000 ms: Ok(())
            pick: Idle
            pick: Idle
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn a_restored_task_skips_admission_and_runs() {
    check(
        "
        tenant 1 queued=1
        submit t1 tenant=1
        submit t2 tenant=1
        restore t3 tenant=1 band=P2
        restore t1 tenant=1
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: REJECT_TENANT_QUEUE_FULL (limit tenant:1:queued_tasks is full)
            restore 3: Ok(())
            restore 1: Err(DuplicateTask(TaskId(1)))
            dispatch 3 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=2
            dispatch 1 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn a_resumed_attempt_holds_its_provider_slot_until_it_ends() {
    check(
        "
        provider 0 concurrency=1
        provider 1 concurrency=0
        tenant 1
        resume t1 tenant=1 state=running attempt=2
        submit t2 tenant=1
        dispatch
        done t1
        dispatch
        ",
        expect![[r#"
            resume 1: Ok(()) state=Some(Running)
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}

#[test]
fn resumed_work_past_the_capacity_is_held_and_nothing_new_starts_until_it_drains() {
    check(
        "
        provider 0 concurrency=1
        provider 1 concurrency=0
        tenant 1
        resume t1 tenant=1 state=running
        resume t2 tenant=1 state=unknown
        submit t3 tenant=1
        dispatch
        done t1
        dispatch
        notfound t2
        dispatch
        ",
        expect![[r#"
            resume 1: Ok(()) state=Some(Running)
            resume 2: Ok(()) state=Some(SubmitUnknown)
            3: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            done 1 (was Some(Running)): Ok(AwaitingMedia); media 1 Succeeded
            notfound 2: Ok(Requeued { eligible_at: Time(0) })
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=2
        "#]],
    );
}

#[test]
fn only_live_attempts_of_known_providers_and_with_attempts_left_come_back() {
    check(
        "
        tenant 1
        resume t1 tenant=1 state=queued
        resume t2 tenant=1 state=running provider=99
        resume t3 tenant=1 state=running
        resume t3 tenant=1 state=running
        resume t4 tenant=1 state=running attempt=65
        restore t5 tenant=1 attempts=64
        restore t6 tenant=1 attempts=63
        ",
        expect![[r#"
            resume 1: Err(NotResumable(TaskId(1), Queued)) state=None
            resume 2: Err(UnknownProvider(ProviderId(99))) state=None
            resume 3: Ok(()) state=Some(Running)
            resume 3: Err(DuplicateTask(TaskId(3))) state=Some(Running)
            resume 4: Err(AttemptsExhausted(TaskId(4), 65)) state=None
            restore 5: Err(AttemptsExhausted(TaskId(5), 65))
            restore 6: Ok(())
        "#]],
    );
}

#[test]
fn a_suspended_tenant_takes_no_new_work_and_starts_none_until_it_is_resumed() {
    check(
        "
        lane STANDARD capacity=4
        tenant 1
        tenant 2
        submit t1 tenant=1 deadline=100
        submit t2 tenant=1
        suspend 1 on
        submit t3 tenant=1
        submit t4 tenant=2
        dispatch
        tick 200
        dispatch
        suspend 1 off
        submit t5 tenant=1
        dispatch
        ",
        expect![[r#"
            1: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Immediate
            2: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            3: REJECT_RESOURCE_CLASS_DISABLED (the tenant is suspended: it takes no new work until it is resumed)
            4: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 4 tenant=2 lane=STANDARD provider=0 mode=Normal attempt=1
            expired 1
            5: ACCEPTED lane=STANDARD band=P3 fairness=1.000u level=Short
            dispatch 2 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
            dispatch 5 tenant=1 lane=STANDARD provider=0 mode=Normal attempt=1
        "#]],
    );
}
