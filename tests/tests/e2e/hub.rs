//! Models named on the Hub, fetched from a stand-in that speaks its HTTP API (the Hub
//! itself cannot be reached from here): the cache layout, a resumed transfer, a file that
//! fails its hash, the Hub's refusals, offline use, and a cluster that serves a name.

use std::path::{Path, PathBuf};

use e2e::hub::{Fault, HubRepo, HubState, StandInHub};
use e2e::{scratch, tiny_model, Cluster, Mode};
use hub::{HubError, Options, Resolved};

const REPO: &str = "tandem-test/tiny";

/// A stand-in serving the tiny model as `REPO`, with a README and a second layout of the
/// weights beside it that a fetch must leave.
async fn serving_tiny(state: HubState) -> (StandInHub, HubRepo) {
    let mut repo = HubRepo::from_dir(&tiny_model(), 0xa1);
    repo.files.push(("README.md".into(), b"# tiny\n".to_vec()));
    repo.files
        .push(("consolidated.safetensors".into(), vec![0u8; 4096]));
    let mut state = state;
    state.repos.insert(REPO.into(), repo.clone());
    (StandInHub::start(state).await, repo)
}

/// Options for a fresh cache under the scratch folder.
fn options(hub: &StandInHub, tag: &str) -> Options {
    let cache = scratch().join(format!("hf-{tag}"));
    let _ = std::fs::remove_dir_all(&cache);
    Options {
        endpoint: hub.url.clone(),
        cache,
        token: None,
        offline: false,
        retries: 0,
    }
}

async fn resolve(spec: &str, opts: &Options) -> Result<Resolved, HubError> {
    let (spec, opts) = (PathBuf::from(spec), opts.clone());
    tokio::task::spawn_blocking(move || hub::resolve(&spec, &opts))
        .await
        .expect("the fetch does not panic")
}

fn snapshot(opts: &Options, repo: &HubRepo) -> PathBuf {
    opts.cache
        .join("models--tandem-test--tiny/snapshots")
        .join(&repo.commit)
}

/// The weight transfers (ranged GETs of more than one byte) the stand-in saw for `file`.
fn transfers(hub: &StandInHub, file: &str) -> Vec<Option<String>> {
    hub.seen()
        .into_iter()
        .filter(|(p, r)| p.ends_with(file) && r.as_deref() != Some("bytes=0-0"))
        .map(|(_, r)| r)
        .collect()
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).ok() == std::fs::read(b).ok()
}

#[tokio::test]
async fn a_name_is_fetched_into_the_hub_cache_once_and_found_offline() {
    let (hub, repo) = serving_tiny(HubState::default()).await;
    let mut opts = options(&hub, "fetch");
    let got = resolve(REPO, &opts).await.expect("fetching the tiny model");
    assert_eq!(got.path, snapshot(&opts, &repo));
    assert_eq!(got.served_name.as_deref(), Some(REPO));
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(same_bytes(&got.path.join(f), &tiny_model().join(f)), "{f}");
    }
    assert!(!got.path.join("README.md").exists());
    assert!(!got.path.join("consolidated.safetensors").exists());
    let refs = opts.cache.join("models--tandem-test--tiny/refs/main");
    assert_eq!(std::fs::read_to_string(refs).unwrap().trim(), repo.commit);

    // Again: the listing is read, nothing is transferred.
    let before = hub.seen().len();
    assert_eq!(resolve(REPO, &opts).await.unwrap().path, got.path);
    assert_eq!(hub.seen().len(), before + 1, "{:?}", hub.seen());

    // Offline, and with the Hub out of reach: the cached copy, no request at all.
    opts.offline = true;
    assert_eq!(resolve(REPO, &opts).await.unwrap().path, got.path);
    let pinned = format!("{REPO}@{}", repo.commit);
    assert_eq!(resolve(&pinned, &opts).await.unwrap().path, got.path);
    assert_eq!(hub.seen().len(), before + 1);
    opts.offline = false;
    opts.endpoint = format!("http://127.0.0.1:{}", e2e::free_port());
    assert_eq!(resolve(REPO, &opts).await.unwrap().path, got.path);
    match resolve("tandem-test/other", &opts).await {
        Err(HubError::Transport { .. }) => {}
        other => panic!("{other:?}"),
    }
    opts.offline = true;
    match resolve("tandem-test/other", &opts).await {
        Err(e @ HubError::Offline { .. }) => assert!(e.to_string().contains("HF_HUB_OFFLINE")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_transfer_that_breaks_off_resumes_where_it_stopped() {
    let mut state = HubState::default();
    state
        .faults
        .insert("model.safetensors".into(), Fault::CutAfter(3000));
    let (hub, repo) = serving_tiny(state).await;
    let opts = options(&hub, "resume");
    match resolve(REPO, &opts).await {
        Err(HubError::Interrupted { file, .. }) => assert_eq!(file, "model.safetensors"),
        other => panic!("the cut transfer should fail: {other:?}"),
    }
    let got = resolve(REPO, &opts).await.expect("resuming");
    let file = got.path.join("model.safetensors");
    assert!(same_bytes(&file, &tiny_model().join("model.safetensors")));
    let size = std::fs::metadata(&file).unwrap().len();
    assert_eq!(
        transfers(&hub, "model.safetensors"),
        [
            Some("bytes=0-".to_string()),
            Some("bytes=3000-".to_string())
        ],
        "the second transfer asks only for what the first did not bring"
    );
    assert!(size > 3000);
    assert_eq!(got.path, snapshot(&opts, &repo));
}

#[tokio::test]
async fn a_file_that_fails_its_hash_is_deleted_and_refused() {
    let mut state = HubState::default();
    state
        .faults
        .insert("model.safetensors".into(), Fault::WrongByte);
    let (hub, repo) = serving_tiny(state).await;
    let opts = options(&hub, "hash");
    let err = resolve(REPO, &opts).await.expect_err("the hash differs");
    match &err {
        HubError::Corrupt {
            file,
            what,
            expected,
            ..
        } => {
            assert_eq!(file, "model.safetensors");
            assert_eq!(*what, "the SHA-256");
            let model = std::fs::read(tiny_model().join("model.safetensors")).unwrap();
            assert_eq!(*expected, e2e::hub::sha256_hex(&model));
        }
        other => panic!("{other:?}"),
    }
    let blobs = opts.cache.join("models--tandem-test--tiny/blobs");
    let model = std::fs::read(tiny_model().join("model.safetensors")).unwrap();
    assert!(!blobs.join(e2e::hub::sha256_hex(&model)).exists());
    assert!(!snapshot(&opts, &repo).join("model.safetensors").exists());
    hub.state.lock().unwrap().faults.clear();
    let got = resolve(REPO, &opts).await.expect("fetched anew");
    assert!(same_bytes(
        &got.path.join("model.safetensors"),
        &tiny_model().join("model.safetensors")
    ));
}

#[tokio::test]
async fn gated_missing_and_unknown_names_say_what_to_do() {
    let mut state = HubState {
        granted: vec!["hf_granted".into()],
        ..HubState::default()
    };
    let mut gated = HubRepo::from_dir(&tiny_model(), 0xb2);
    gated.gated = true;
    state.repos.insert("tandem-test/gated".into(), gated);
    let (hub, _) = serving_tiny(state).await;
    let mut opts = options(&hub, "refusals");
    match resolve("tandem-test/gated", &opts).await {
        Err(e @ HubError::Gated { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("{}/tandem-test/gated", hub.url)),
                "{msg}"
            );
            assert!(msg.contains("HF_TOKEN"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    opts.token = Some("hf_not_granted".into());
    assert!(matches!(
        resolve("tandem-test/gated", &opts).await,
        Err(HubError::GatedDenied { .. })
    ));
    opts.token = Some("hf_granted".into());
    resolve("tandem-test/gated", &opts)
        .await
        .expect("a granted token reads a gated repository");
    opts.token = None;
    assert!(matches!(
        resolve("tandem-test/missing", &opts).await,
        Err(HubError::NotFound { .. })
    ));
    assert!(matches!(
        resolve(&format!("{REPO}@v9"), &opts).await,
        Err(HubError::RevisionNotFound { .. })
    ));
    match resolve(&format!("{REPO}:Q4_K_M"), &opts).await {
        Err(HubError::NoSuchQuant { quant, .. }) => assert_eq!(quant, "Q4_K_M"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        resolve("not a name", &opts).await,
        Err(HubError::BadName { .. })
    ));
}

#[tokio::test]
async fn a_cluster_started_with_a_hub_name_fetches_it_once_and_serves() {
    let (hub, repo) = serving_tiny(HubState::default()).await;
    let opts = options(&hub, "cluster");
    // Whatever the machine's own Hugging Face settings, these processes fetch from the
    // stand-in into a fresh cache.
    let env = [
        ("HF_ENDPOINT", hub.url.as_str()),
        ("HF_HUB_CACHE", opts.cache.to_str().unwrap()),
        ("HF_HUB_OFFLINE", "0"),
        ("HF_TOKEN", ""),
        ("HF_TOKEN_PATH", "/nonexistent"),
    ];
    let cluster = Cluster::launch_env(Mode::Pd, Path::new(REPO), &[], &env).await;
    cluster.assert_serving("a model named on the Hub").await;
    // Three processes started at once; one fetched while the others waited, then found
    // the files in place.
    assert_eq!(
        transfers(&hub, "model.safetensors").len(),
        1,
        "{}",
        cluster.logs()
    );
    assert!(same_bytes(
        &snapshot(&opts, &repo).join("model.safetensors"),
        &tiny_model().join("model.safetensors")
    ));
}

/// What the Helm chart runs: `tandem-fetch` (an init container) fills the cache, then the
/// serving binaries find the name there offline and ask the Hub for nothing.
#[tokio::test]
async fn tandem_fetch_fills_the_cache_that_an_offline_cluster_serves_from() {
    let (hub, repo) = serving_tiny(HubState::default()).await;
    let opts = options(&hub, "init");
    let cache = opts.cache.to_str().unwrap();
    let fetch = |model: &str| {
        tokio::process::Command::new(e2e::bin("tandem-fetch"))
            .args(["--model", model])
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HUB_CACHE", cache)
            .env("HF_HUB_OFFLINE", "0")
            .env("HF_TOKEN", "")
            .env("HF_TOKEN_PATH", "/nonexistent")
            .output()
    };
    let out = fetch(&format!("hf://{REPO}")).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        snapshot(&opts, &repo).to_str().unwrap()
    );
    let out = fetch("tandem-test/absent").await.unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tandem-test/absent"), "{stderr}");

    let asked = hub.seen().len();
    let env = [
        ("HF_ENDPOINT", hub.url.as_str()),
        ("HF_HUB_CACHE", cache),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_TOKEN", ""),
        ("HF_TOKEN_PATH", "/nonexistent"),
    ];
    let cluster = Cluster::launch_env(Mode::Pd, Path::new(REPO), &[], &env).await;
    cluster
        .assert_serving("a Hub model fetched by tandem-fetch")
        .await;
    assert_eq!(hub.seen().len(), asked, "{}", cluster.logs());
}
