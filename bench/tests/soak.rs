//! The soak in CI: about two minutes of steady mixed load on the tiny model through a
//! router, two prefill and two decode nodes found through etcd, with a tenth of the clients
//! leaving mid-stream, one P and one D killed and restarted, and hostile peers and broken
//! clients on the decode nodes' and the router's ports all along; every check must pass.

use bench::soak::{run, SoakConfig};
use clap::Parser;

#[tokio::test(flavor = "multi_thread")]
async fn a_short_soak_leaks_nothing() {
    let cfg = SoakConfig::try_parse_from([
        "soak",
        "--duration-s",
        "90",
        "--warmup-s",
        "15",
        "--clients",
        "4",
        "--think-ms",
        "50",
        "--kill-prefill-at-s",
        "25",
        "--kill-decode-at-s",
        "55",
        "--restart-after-s",
        "3",
        "--hostile",
    ])
    .expect("the soak's flags");
    let report = run(&cfg).await.expect("the soak runs");
    let summary = report.summary();
    println!("{summary}");
    let failed: Vec<_> = report.checks.iter().filter(|c| !c.passed).collect();
    assert!(
        failed.is_empty(),
        "failed checks: {failed:#?}\n{summary}\nunexpected requests: {:#?}\nlogs in {}",
        report.unexpected,
        report.logs
    );
    // What the checks stand on actually happened.
    let count = |outcome: &str| report.outcomes.get(outcome).copied().unwrap_or(0);
    assert!(count("ok") >= 100, "{summary}");
    let share = count("dropped") as f64 / report.requests as f64;
    assert!((0.05..0.15).contains(&share), "{share} left: {summary}");
    let killed: Vec<&str> = report.kills.iter().map(|k| k.process.as_str()).collect();
    assert_eq!(killed, ["prefill0", "decode0"], "{summary}");
    assert_eq!(report.processes.len(), 5, "{summary}");
    for p in &report.processes {
        assert!(p.baseline.is_some() && p.end.is_some(), "{p:?}");
    }
    let hostile = report.hostile.as_ref().expect("hostile peers ran");
    assert_eq!(
        report.router_counted.values().sum::<u64>(),
        report.requests as u64 + hostile.router_saw().values().sum::<u64>(),
        "{summary}"
    );
}
