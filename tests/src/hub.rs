//! A stand-in for the Hugging Face Hub on a local socket: the Hub cannot be reached from the
//! test machines, so this speaks the part of its HTTP API that a fetch uses, as the Hub
//! answers it (listings with sizes and hashes, `resolve/` with ranges, `X-Error-Code` on
//! refusals), and produces the faults a real network does: a transfer that breaks off and
//! bytes that do not match their hash.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::json;
use sha1::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A repository the stand-in serves.
#[derive(Clone, Default)]
pub struct HubRepo {
    /// The commit `main` is at (40 hex digits).
    pub commit: String,
    /// Path and bytes of each file.
    pub files: Vec<(String, Vec<u8>)>,
    /// Gated: served only to `HubState::granted` tokens.
    pub gated: bool,
}

impl HubRepo {
    /// Every file of `dir` (not its folders), at a commit made from `seed`.
    pub fn from_dir(dir: &std::path::Path, seed: u8) -> Self {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .expect("reading the model folder")
            .flatten()
            .filter(|e| e.path().is_file())
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).expect("reading a model file"))
            })
            .collect();
        files.sort();
        Self {
            commit: format!("{seed:02x}").repeat(20),
            files,
            gated: false,
        }
    }
}

/// What a fault does to one file.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// The next transfer of the file stops after this many body bytes (the connection
    /// closes early, as a dropped link does).
    CutAfter(usize),
    /// Every transfer sends the file with one byte changed.
    WrongByte,
}

/// What the stand-in serves and has seen.
#[derive(Default)]
pub struct HubState {
    pub repos: HashMap<String, HubRepo>,
    /// Tokens that may read gated repositories; any other `Bearer` token is valid but not
    /// granted, as a real account that has not accepted the terms.
    pub granted: Vec<String>,
    /// Faults by file path.
    pub faults: HashMap<String, Fault>,
    /// Each request's path and `Range` header, in order.
    pub seen: Vec<(String, Option<String>)>,
}

/// A running stand-in; it serves until the test ends.
pub struct StandInHub {
    /// Its address, for `HF_ENDPOINT`.
    pub url: String,
    pub state: Arc<Mutex<HubState>>,
}

impl StandInHub {
    /// Starts serving on a free port.
    pub async fn start(state: HubState) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(answer(sock, shared.clone()));
            }
        });
        Self { url, state }
    }

    /// The requests seen so far, as (path, range).
    pub fn seen(&self) -> Vec<(String, Option<String>)> {
        self.state.lock().expect("state").seen.clone()
    }
}

/// The hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&sha2::Sha256::digest(bytes))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the file is kept in LFS on the Hub (weights are; configs are not).
fn in_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".gguf")
}

struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    /// Send only this much of the body, then close.
    cut: Option<usize>,
}

impl Reply {
    fn refuse(status: u16, code: &str) -> Self {
        Self {
            status,
            headers: vec![("X-Error-Code", code.into())],
            body: json!({"error": code}).to_string().into_bytes(),
            cut: None,
        }
    }
}

async fn answer(mut sock: TcpStream, state: Arc<Mutex<HubState>>) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 << 10 {
        if sock.read(&mut byte).await.unwrap_or(0) == 0 {
            return;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.lines();
    let target = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .unwrap_or("/");
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let path = target.split('?').next().unwrap_or("").to_string();
    let reply = {
        let mut st = state.lock().expect("state");
        st.seen.push((path.clone(), headers.get("range").cloned()));
        route(&mut st, &path, &headers)
    };
    let mut out = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", reply.status);
    for (k, v) in &reply.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", reply.body.len()));
    let body = &reply.body[..reply.cut.unwrap_or(reply.body.len()).min(reply.body.len())];
    let _ = sock.write_all(out.as_bytes()).await;
    let _ = sock.write_all(body).await;
    let _ = sock.shutdown().await;
}

fn route(st: &mut HubState, path: &str, headers: &HashMap<String, String>) -> Reply {
    let token = headers
        .get("authorization")
        .and_then(|a| a.strip_prefix("Bearer "));
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let parts: Vec<&str> = rest.splitn(4, '/').collect();
        let [org, name, "revision", rev] = parts.as_slice() else {
            return Reply::refuse(404, "EntryNotFound");
        };
        return listing(st, &format!("{org}/{name}"), rev, token);
    }
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let [org, name, "resolve", rev, file] = parts.as_slice() else {
        return Reply::refuse(404, "EntryNotFound");
    };
    let repo_id = format!("{org}/{name}");
    let Some(repo) = st.repos.get(&repo_id).cloned() else {
        return Reply::refuse(if token.is_some() { 404 } else { 401 }, "RepoNotFound");
    };
    if repo.gated {
        match token {
            None => return Reply::refuse(401, "GatedRepo"),
            Some(t) if !st.granted.iter().any(|g| g == t) => {
                return Reply::refuse(403, "GatedRepo")
            }
            Some(_) => {}
        }
    }
    if *rev != "main" && *rev != repo.commit {
        return Reply::refuse(404, "RevisionNotFound");
    }
    let Some((_, bytes)) = repo.files.iter().find(|(n, _)| n == file) else {
        return Reply::refuse(404, "EntryNotFound");
    };
    let mut bytes = bytes.clone();
    let size = bytes.len();
    let etag = if in_lfs(file) {
        sha256_hex(&bytes)
    } else {
        git_blob_id(&bytes)
    };
    let range = headers.get("range").and_then(|r| r.strip_prefix("bytes="));
    let (from, to) = match range.and_then(|r| r.split_once('-')) {
        Some((a, b)) => (
            a.parse().unwrap_or(0),
            b.parse().unwrap_or(size.saturating_sub(1)),
        ),
        None => (0, size.saturating_sub(1)),
    };
    let mut cut = None;
    let whole_range = to + 1 - from > 1;
    match st.faults.get(*file).copied() {
        Some(Fault::WrongByte) => bytes[size / 2] ^= 0xff,
        Some(Fault::CutAfter(n)) if whole_range => {
            cut = Some(n);
            st.faults.remove(*file);
        }
        _ => {}
    }
    Reply {
        status: 206,
        headers: vec![
            ("ETag", format!("\"{etag}\"")),
            ("X-Repo-Commit", repo.commit.clone()),
            ("Content-Range", format!("bytes {from}-{to}/{size}")),
        ],
        body: bytes[from..=to].to_vec(),
        cut,
    }
}

fn listing(st: &HubState, repo_id: &str, rev: &str, token: Option<&str>) -> Reply {
    let Some(repo) = st.repos.get(repo_id) else {
        return Reply::refuse(if token.is_some() { 404 } else { 401 }, "RepoNotFound");
    };
    if rev != "main" && rev != repo.commit {
        return Reply::refuse(404, "RevisionNotFound");
    }
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|(name, bytes)| {
            let mut s =
                json!({"rfilename": name, "size": bytes.len(), "blobId": git_blob_id(bytes)});
            if in_lfs(name) {
                s["lfs"] =
                    json!({"sha256": sha256_hex(bytes), "size": bytes.len(), "pointerSize": 134});
            }
            s
        })
        .collect();
    Reply {
        status: 200,
        headers: vec![("Content-Type", "application/json".into())],
        body: json!({"id": repo_id, "sha": repo.commit, "gated": repo.gated, "siblings": siblings})
            .to_string()
            .into_bytes(),
        cut: None,
    }
}

/// Git's id of a blob: SHA-1 of `blob <len>\0` and the bytes.
fn git_blob_id(bytes: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}
