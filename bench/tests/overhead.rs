//! The router-overhead bench, briefly, on the tiny model: the direct clients and Tandem's
//! router in both modes in front of the zero-compute nodes answer every request, the
//! router's CPU time is read, and a peer that is not installed is reported as skipped.

use bench::overhead::{run, OverheadConfig, Setup};
use clap::Parser;

fn config(extra: &[&str]) -> OverheadConfig {
    let model = e2e::tiny_model();
    let bins = e2e::bin_dir();
    let mut args = vec![
        "router-overhead".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--bin-dir".into(),
        bins.display().to_string(),
        "--peers-venv".into(),
        "/nonexistent/venv".into(),
        "--rounds".into(),
        "1".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    OverheadConfig::try_parse_from(args).expect("the bench's flags")
}

#[tokio::test(flavor = "multi_thread")]
async fn tandem_in_front_of_zero_compute_nodes_answers_every_request() {
    let cfg = config(&[
        "--only",
        "direct,tandem-pd,tandem-colocated",
        "--duration-s",
        "0.5",
        "--concurrency",
        "1,4",
        "--tokens",
        "8",
    ]);
    let report = run(&cfg).await.expect("the bench runs");
    let table = report.table();
    println!("{table}");
    // 3 setups, unary and streamed, 2 client counts.
    assert_eq!(report.rows.len(), 12, "{table}");
    for r in &report.rows {
        assert_eq!(r.errors, 0, "{r:?}");
        assert!(r.requests > 0 && r.latency_p50_us > 0.0, "{r:?}");
        let routed = r.setup != Setup::Direct;
        assert_eq!(r.router_cpu_us_per_request.is_some(), routed, "{r:?}");
        if let Some(cpu) = r.router_cpu_us_per_request {
            assert!(cpu > 0.0, "{r:?}");
        }
    }
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
}

#[tokio::test]
async fn a_peer_that_is_not_installed_is_skipped_with_the_reason() {
    let report = run(&config(&["--only", "sglang,vllm-pd"]))
        .await
        .expect("the bench runs");
    assert!(report.rows.is_empty());
    let skipped: Vec<Setup> = report.skipped.iter().map(|(s, _)| *s).collect();
    assert_eq!(skipped, [Setup::Sglang, Setup::VllmPd]);
    assert!(
        report
            .skipped
            .iter()
            .all(|(_, why)| why.contains("/nonexistent/venv")),
        "{:?}",
        report.skipped
    );
}
