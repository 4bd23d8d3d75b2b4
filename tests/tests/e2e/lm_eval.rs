//! A real evaluation client: EleutherAI's `lm-eval` (its `local-chat-completions` model)
//! runs a small local task against SmolLM2 served through P and D, offline.

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
