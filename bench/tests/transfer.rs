//! The transfer bench, briefly, on the tiny model: whole caches reach a real decode node,
//! and with `--ttft` prompts of the same lengths go through a PD cluster, the prefill
//! node's counters giving each request's compute time and transfer tail.

use serde_json::Value;

#[test]
fn transfers_and_ttft_shares_are_measured() {
    let json = e2e::scratch().join(format!("transfer-bench-{}.json", e2e::free_port()));
    let model = e2e::tiny_model();
    let out = std::process::Command::new(e2e::bin("transfer-bench"))
        .args(["--model", &model.display().to_string()])
        .args(["--tokens", "16,64", "--repeats", "1", "--ttft"])
        .args([
            "--ttft-requests",
            "1",
            "--json",
            &json.display().to_string(),
        ])
        .output()
        .expect("transfer-bench runs");
    let printed =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "transfer-bench failed:\n{printed}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = doc["rows"].as_array().expect("wire rows");
    assert_eq!(rows.len(), 2, "{doc}");
    for r in rows {
        assert!(r["bytes_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let ttft = doc["ttft"].as_array().expect("TTFT rows");
    assert_eq!(ttft.len(), 2, "{doc}");
    for (r, want) in ttft.iter().zip([16, 64]) {
        let tokens = r["prompt_tokens"].as_u64().unwrap();
        // Decoding a token prefix and encoding it again may merge a pair at the cut.
        assert!(
            tokens.abs_diff(want) <= 2,
            "{tokens} tokens for {want}: {r}"
        );
        let (ttft, compute, tail) = (
            r["ttft_s"].as_f64().unwrap(),
            r["compute_s"].as_f64().unwrap(),
            r["transfer_tail_s"].as_f64().unwrap(),
        );
        assert!(compute > 0.0 && tail > 0.0, "{r}");
        assert!(
            compute + tail <= ttft,
            "the prefill node's times exceed TTFT: {r}"
        );
    }
}
