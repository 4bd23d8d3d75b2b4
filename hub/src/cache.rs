//! The `huggingface_hub` cache as it lies on disk: `models--org--name/` with `refs/<rev>`
//! (a commit), `snapshots/<commit>/<file>` (links into `blobs/`). Found offline here, and
//! locked while one process fetches into it.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use crate::select::{self, Entry};
use crate::{HubError, ModelRef, Options};

/// `models--org--name` under the cache.
pub(crate) fn repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

/// A full commit id, which the cache uses as a snapshot's name.
pub(crate) fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// The cached model `model` names, whole, without the network.
pub(crate) fn find(model: &ModelRef, opts: &Options) -> Result<PathBuf, HubError> {
    let dir = repo_dir(&opts.cache, &model.repo);
    let missing = |what: String| HubError::Offline {
        repo: model.repo.clone(),
        revision: model.revision.clone(),
        cache: opts.cache.clone(),
        missing: what,
    };
    let commit = if is_commit(&model.revision) {
        model.revision.clone()
    } else {
        let r = dir.join("refs").join(&model.revision);
        let c = std::fs::read_to_string(&r).map_err(|_| missing(r.display().to_string()))?;
        c.trim().to_string()
    };
    if !is_commit(&commit) {
        return Err(missing(format!("a commit in refs/{}", model.revision)));
    }
    let snapshot = dir.join("snapshots").join(&commit);
    let mut names = Vec::new();
    list(&snapshot, "", &mut names);
    names.sort();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let choice = select::choose(&model.repo, &refs, model.quant.as_deref())?;
    if let Some(gone) = first_missing(&snapshot, &choice.entry) {
        return Err(missing(gone));
    }
    Ok(match choice.entry {
        Entry::Folder => snapshot,
        Entry::File(f) => snapshot.join(f),
    })
}

/// What a folder lacks to load: its configs, or a shard its index names (an earlier
/// fetch may have stopped between files).
fn first_missing(snapshot: &Path, entry: &Entry) -> Option<String> {
    if *entry != Entry::Folder {
        return None;
    }
    let mut need: Vec<String> = ["config.json", "tokenizer.json"].map(String::from).to_vec();
    if let Ok(index) = std::fs::read(snapshot.join("model.safetensors.index.json")) {
        let map = serde_json::from_slice::<serde_json::Value>(&index)
            .ok()
            .and_then(|v| v.get("weight_map").cloned());
        if let Some(serde_json::Value::Object(map)) = map {
            need.extend(map.values().filter_map(|v| v.as_str().map(String::from)));
        }
    }
    need.into_iter().find(|n| !snapshot.join(n).exists())
}

/// Every file under `dir` (links followed), as repository paths.
fn list(dir: &Path, prefix: &str, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = format!("{prefix}{}", e.file_name().to_string_lossy());
        let path = e.path();
        if path.is_dir() {
            list(&path, &format!("{name}/"), out);
        } else if path.exists() {
            out.push(name);
        }
    }
}

/// One process at a time fetches a repository on this host: the others wait, then find
/// its files in place. Released when dropped (the descriptor closes).
pub(crate) struct RepoLock {
    _file: File,
}

impl RepoLock {
    pub(crate) fn take(dir: &Path, repo: &str) -> Result<Self, HubError> {
        let io = |source| HubError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let file = File::create(dir.join(".tandem-fetch.lock")).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                tracing::info!(repo, "waiting for another process fetching this model");
                file.lock().map_err(io)?;
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        Ok(Self { _file: file })
    }
}
