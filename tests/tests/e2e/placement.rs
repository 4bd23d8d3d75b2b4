//! Conditional disaggregation (`--local-prefill-max-tokens`): where the router has each
//! prompt computed, why, and that the tokens never depend on it.

use std::sync::LazyLock;

use e2e::{tiny_model, wait_metric, Cluster, Mode};
use serde_json::{json, Value};

use crate::cluster::SEE;

static DISAGGREGATED: LazyLock<Value> =
    LazyLock::new(|| json!({"node": "prefill_node", "reason": "disaggregated"}));

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

/// Conditional disaggregation: under PD with `--local-prefill-max-tokens`, a prompt within
/// it is computed by its decode node (the prefill node never sees it) and a longer one goes
/// through the prefill node; both give exactly the tokens of plain PD, and the router counts
/// each placement with its reason.
#[tokio::test]
async fn short_prompts_prefilled_on_their_decode_node_give_the_pd_tokens() {
    let model = tiny_model();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let cond = Cluster::start(Mode::Pd, &model, &["--local-prefill-max-tokens", "16"]).await;
    let short = "Hello there";
    let long = "The router speaks the OpenAI chat completions API. ".repeat(3);
    let mut shorts = 0.0;
    let mut longs = 0.0;
    for (prompt, local) in [(short, true), (long.as_str(), false), (short, true)] {
        for sampling in [
            json!({"temperature": 0}),
            json!({"temperature": 0.9, "seed": 7}),
        ] {
            let mut body =
                json!({"model": "test", "prompt": prompt, "max_tokens": 12, "ignore_eos": true});
            body.as_object_mut()
                .unwrap()
                .extend(sampling.as_object().unwrap().clone());
            let (s1, a) = pd.post("/v1/completions", &body).await;
            let (s2, b) = cond.post("/v1/completions", &body).await;
            assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
            let prompt_tokens = b["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(prompt_tokens <= 16, local, "{prompt_tokens} prompt tokens");
            assert_eq!(text_of(&b), text_of(&a), "{prompt:?} {sampling}");
            assert_eq!(b["usage"]["completion_tokens"], 12);
            let want = if local {
                json!({"node": "decode_node", "reason": "short_prompt"})
            } else {
                DISAGGREGATED.clone()
            };
            assert_eq!(b["usage"]["prefill_placement"], want, "{b}");
            assert_eq!(a["usage"]["prefill_placement"], *DISAGGREGATED, "{a}");
            if local {
                shorts += 1.0;
            } else {
                longs += 1.0;
            }
        }
    }
    let router = cond.router_metrics().await;
    let placed = |labels: &str| {
        e2e::metric(&router, "router_prefill_placements_total", labels).unwrap_or(0.0)
    };
    assert_eq!(
        placed("{placement=\"decode_node\",reason=\"short_prompt\"}"),
        shorts,
        "{router}"
    );
    assert_eq!(
        placed("{placement=\"prefill_node\",reason=\"disaggregated\"}"),
        longs,
        "{router}"
    );
    let prefill = e2e::scrape(cond.prefill.as_deref().unwrap()).await;
    assert_eq!(
        e2e::metric(
            &prefill,
            "prefill_requests_total",
            "{outcome=\"completed\"}"
        ),
        Some(longs),
        "only the long prompts reached the prefill node:\n{prefill}"
    );
}

/// A short prompt whose decode node has no room goes through the prefill node: here a
/// long prompt holds half the decode node's KV budget while its prefill node is paused
/// (SIGSTOP, the only way to hold a prompt there), so the short one cannot fit beside it.
#[tokio::test]
async fn a_short_prompt_goes_to_the_prefill_node_when_its_decode_node_is_full() {
    let model = tiny_model();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    // Sixteen blocks of 16 positions: the long request below takes seven or eight (the
    // node counts one position more than the router, and its allocator's share), and
    // the short one needs ten.
    let cond = Cluster::start_full(
        Mode::Pd,
        &model,
        &["--local-prefill-max-tokens", "16"],
        &[],
        &["--kv-blocks", "16", "--kv-block-tokens", "16"],
    )
    .await;
    let long_prompt = "The router speaks the OpenAI chat completions API. ".repeat(2);
    let (_, counted) = cond
        .post(
            "/tokenize",
            &json!({"model": "test", "prompt": long_prompt}),
        )
        .await;
    let prompt_tokens = counted["count"].as_u64().unwrap();
    assert!((17..100).contains(&prompt_tokens), "{counted}");
    let long = json!({"model": "test", "prompt": long_prompt,
        "max_tokens": 112 - prompt_tokens, "ignore_eos": true});
    let short = json!({"model": "test", "prompt": "Hello there", "max_tokens": 150,
        "temperature": 0.9, "seed": 3, "ignore_eos": true});
    let (_, expected) = pd.post("/v1/completions", &short).await;

    let prefill = &cond.procs[1];
    prefill.signal("STOP");
    let held = tokio::spawn({
        let (url, body) = (format!("{}/v1/completions", cond.url), long.clone());
        async move { e2e::post(&url, &body).await }
    });
    // The long request's Generate call holds its blocks: the router counts them from
    // before the call, the node from its reservation.
    wait_metric(&cond.decode, "decode_awaited_transfers", "", 1.0, SEE).await;
    let waiting = tokio::spawn({
        let (url, body) = (format!("{}/v1/completions", cond.url), short.clone());
        async move { e2e::post(&url, &body).await }
    });
    let router = cond.ops.clone();
    let no_room = "{placement=\"prefill_node\",reason=\"no_room\"}";
    wait_metric(
        &router,
        "router_prefill_placements_total",
        no_room,
        1.0,
        SEE,
    )
    .await;
    prefill.signal("CONT");

    let (status, long_out) = held.await.unwrap();
    assert_eq!(status, 200, "{long_out}");
    assert_eq!(long_out["usage"]["prefill_placement"], *DISAGGREGATED);
    let (status, short_out) = waiting.await.unwrap();
    assert_eq!(status, 200, "{short_out}");
    assert_eq!(
        short_out["usage"]["prefill_placement"],
        json!({"node": "prefill_node", "reason": "no_room"})
    );
    assert_eq!(text_of(&short_out), text_of(&expected));
    // With room again, the same prompt stays on its decode node, once the router has seen
    // the room: the node's free blocks come with its next health probe. Every answer on the
    // way is the same text.
    let local = json!({"node": "decode_node", "reason": "short_prompt"});
    let again = e2e::poll_until(SEE, || async {
        let (status, again) = cond.post("/v1/completions", &short).await;
        assert_eq!(status, 200, "{again}");
        assert_eq!(text_of(&again), text_of(&expected));
        (again["usage"]["prefill_placement"] == local).then_some(())
    })
    .await;
    assert!(
        again.is_some(),
        "the short prompt never stayed on its decode node"
    );
}
