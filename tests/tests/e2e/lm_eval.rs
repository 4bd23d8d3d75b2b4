//! A real evaluation client: EleutherAI's `lm-eval` runs small local tasks against SmolLM2
//! served through P and D, offline: a generation task with its `local-chat-completions`
//! model, and a loglikelihood task with `local-completions`, which tokenizes through the
//! router's /tokenize and sends token-id prompts with echo and logprobs.

use std::process::Command;

use e2e::{root, scratch, smollm2, venv_bin, Cluster, Mode};
use serde_json::Value;

#[tokio::test]
async fn lm_eval_local_chat_completions_scores_smollm2_through_pd() {
    let c = Cluster::start(Mode::Pd, &smollm2(), &[]).await;
    let out = scratch().join("lm-eval");
    let task_dir = root().join("tests/lm_eval");
    let args = format!(
        "model={},base_url={}/v1/chat/completions,tokenizer_backend=None,num_concurrent=2,max_retries=1",
        c.model_name, c.url
    );
    let output = Command::new(venv_bin("lm_eval"))
        .current_dir(&task_dir)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HOME", scratch().join("hf"))
        .args(["--model", "local-chat-completions", "--apply_chat_template"])
        .args(["--model_args", &args])
        .args([
            "--include_path",
            ".",
            "--tasks",
            "tandem_capitals",
            "--log_samples",
        ])
        .arg("--output_path")
        .arg(&out)
        .output()
        .expect("running lm_eval");
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "lm_eval failed:\n{log}\n{}",
        c.logs()
    );
    let results = find(&out, "results_");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    let score = &v["results"]["tandem_capitals"]["exact_match,strip"];
    assert_eq!(
        score.as_f64(),
        Some(1.0),
        "SmolLM2 names all eight capitals greedily: {v}"
    );
    let samples = std::fs::read_to_string(find(&out, "samples_tandem_capitals")).unwrap();
    assert_eq!(samples.lines().count(), 8, "every question was asked");
}

#[tokio::test]
async fn lm_eval_loglikelihoods_equal_the_engine_run_directly() {
    let model = smollm2();
    let c = Cluster::start(Mode::Pd, &model, &[]).await;
    let out = scratch().join("lm-eval-choice");
    let args = format!(
        "model={},base_url={}/v1/completions,tokenizer_backend=remote,num_concurrent=2,max_retries=1",
        c.model_name, c.url
    );
    let output = Command::new(venv_bin("lm_eval"))
        .current_dir(root().join("tests/lm_eval"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HOME", scratch().join("hf"))
        .args(["--model", "local-completions", "--model_args", &args])
        .args(["--include_path", ".", "--tasks", "tandem_capitals_choice"])
        .arg("--log_samples")
        .arg("--output_path")
        .arg(&out)
        .output()
        .expect("running lm_eval");
    assert!(
        output.status.success(),
        "lm_eval failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stderr),
        c.logs()
    );
    let loaded = engine::load(&model, &candle_core::Device::Cpu).expect("loading the model");
    let samples = std::fs::read_to_string(find(&out, "samples_tandem_capitals_choice")).unwrap();
    let mut compared = 0;
    for line in samples.lines() {
        let s: Value = serde_json::from_str(line).unwrap();
        let doc = &s["doc"];
        let context = doc["question"].as_str().unwrap();
        for (i, choice) in doc["choices"].as_array().unwrap().iter().enumerate() {
            let served: f64 = match &s["resps"][i][0][0] {
                Value::String(x) => x.parse().unwrap(),
                x => x.as_f64().unwrap(),
            };
            let direct = loglikelihood(&loaded, context, &format!(" {}", choice.as_str().unwrap()));
            assert!(
                (served - direct).abs() < 1e-3,
                "{context} {choice}: lm-eval through the router {served}, the engine {direct}"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 12, "four questions of three choices");
    let results = find(&out, "results_");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    assert!(
        v["results"]["tandem_capitals_choice"]["acc,none"].as_f64() >= Some(0.75),
        "{v}"
    );
}

/// The log-probability of `continuation` after `context`, as lm-eval splits them: the
/// whole text tokenized once, the context's tokens counted alone.
fn loglikelihood(loaded: &engine::Loaded, context: &str, continuation: &str) -> f64 {
    let whole = loaded
        .tokenizer
        .encode(&format!("{context}{continuation}"))
        .unwrap();
    let ctxlen = loaded.tokenizer.encode(context).unwrap().len();
    e2e::scored_directly(loaded, &whole, 0)[ctxlen - 1..]
        .iter()
        .map(|s| f64::from(s.logprob))
        .sum()
}

/// The one file under `dir` (lm-eval nests it under the model name) whose name starts with
/// `prefix`.
fn find(dir: &std::path::Path, prefix: &str) -> std::path::PathBuf {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if entry.file_name().to_string_lossy().starts_with(prefix) {
                return path;
            }
        }
    }
    panic!("no {prefix}* under {}", dir.display())
}
