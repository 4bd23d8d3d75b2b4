//! The load generator against a real PD cluster (tiny model): every request is measured,
//! the counts come from the server's usage, and goodput follows the targets.

use std::time::Duration;

use bench::load::{run, summarize, Api, Arrivals, Level, Mix, Shape, Slo};
use e2e::{tiny_model, Cluster, Mode};

fn level(url: &str, api: Api, arrivals: Arrivals, requests: usize) -> Level {
    Level {
        url: url.to_string(),
        api,
        model: "test".into(),
        arrivals,
        requests,
        mix: Mix::Fixed,
        fixed: Shape {
            prompt_tokens: 20,
            output_tokens: 8,
        },
        seed: 3,
        max_in_flight: 64,
        fresh_connections: false,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn loadgen_measures_every_request_open_and_closed_loop() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    for (api, arrivals) in [
        (Api::Chat, Arrivals::Poisson(40.0)),
        (Api::Completions, Arrivals::Clients(3)),
    ] {
        let (records, wall) = run(&level(&c.url, api, arrivals, 12)).await;
        assert_eq!(records.len(), 12);
        for r in &records {
            assert_eq!(r.error, None, "{api:?}: {r:?}\n{}", c.logs());
            assert_eq!(r.output_tokens, 8, "from usage: {r:?}");
            assert!(r.prompt_tokens >= 20, "{r:?}");
            // A chunk per token, and the finishing chunk when it flushes held-back text.
            assert!((7..=8).contains(&r.gaps.len()), "{r:?}");
            assert!(r.ttft > 0.0 && r.latency >= r.ttft, "{r:?}");
            // Text may come only with a later token (the first ones can be parts of a
            // character), never before the first token.
            assert!(r.ttft_text == 0.0 || r.ttft_text >= r.ttft, "{r:?}");
        }
        assert!(
            records.windows(2).all(|w| w[0].sent_at <= w[1].sent_at),
            "records come in send order"
        );
        let loose = Slo {
            ttft_ms: 60_000.0,
            tpot_ms: 60_000.0,
        };
        let s = summarize(arrivals, &records, wall, loose);
        assert_eq!((s.errors, s.goodput), (0, 1.0), "{s:?}");
        assert_eq!(s.mean_output_tokens, 8.0);
        let impossible = Slo {
            ttft_ms: 0.0,
            tpot_ms: 60_000.0,
        };
        assert_eq!(summarize(arrivals, &records, wall, impossible).goodput, 0.0);
    }
    // Poisson arrivals at 40/s spread 12 requests over roughly a quarter second, not all
    // at once: the first and last sends are apart.
    let (records, _) = run(&level(&c.url, Api::Chat, Arrivals::Poisson(40.0), 12)).await;
    let spread = records.last().unwrap().sent_at - records[0].sent_at;
    assert!(
        spread > Duration::from_millis(50).as_secs_f64(),
        "arrivals not spread: {spread}"
    );
}

#[tokio::test]
async fn a_server_error_is_recorded_not_fatal() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let mut l = level(&c.url, Api::Chat, Arrivals::Clients(1), 2);
    l.model = "no-such-model".into();
    let (records, wall) = run(&l).await;
    assert!(records
        .iter()
        .all(|r| r.error.as_deref().is_some_and(|e| e.contains("404"))));
    let s = summarize(
        l.arrivals,
        &records,
        wall,
        Slo {
            ttft_ms: 1e9,
            tpot_ms: 1e9,
        },
    );
    assert_eq!((s.errors, s.goodput), (2, 0.0));
}
