//! Fetching from the Hub: the repository's listing (sizes and hashes), the files chosen
//! from it through `hf-hub`, each new file checked against the listing.

use std::io::Read;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use sha2::Digest;

use crate::cache::{self, is_commit, repo_dir, RepoLock};
use crate::limits::MAX_LISTING_BYTES;
use crate::progress::Reporter;
use crate::select::{self, Entry};
use crate::{HubError, ModelRef, Options};

/// `GET /api/models/{repo}/revision/{rev}?blobs=true`, the fields read.
#[derive(Debug, Deserialize)]
struct Listing {
    /// The commit the revision is at.
    sha: String,
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
    /// The git blob id (SHA-1 of `blob <len>\0<bytes>`): a small file's hash.
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    /// Present for files in LFS (weights): their SHA-256.
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

impl Sibling {
    fn size(&self) -> Option<u64> {
        self.lfs.as_ref().map(|l| l.size).or(self.size)
    }
}

/// The model `model` names, from the cache where whole, else from the Hub.
pub(crate) fn fetch(model: &ModelRef, opts: &Options) -> Result<PathBuf, HubError> {
    let api = ApiBuilder::from_cache(Cache::new(opts.cache.clone()))
        .with_endpoint(opts.endpoint.clone())
        .with_token(opts.token.clone())
        .with_retries(opts.retries)
        .with_user_agent("tandem", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| api_error(e, "", model, opts))?;
    let repo = api.repo(Repo::with_revision(
        model.repo.clone(),
        RepoType::Model,
        model.revision.clone(),
    ));
    let listing = match list(&repo, model, opts) {
        Err(HubError::Transport { url, reason }) => {
            // As huggingface_hub does: with the Hub out of reach, a whole cached copy serves.
            let cached = cache::find(model, opts);
            if let Ok(path) = &cached {
                tracing::warn!(%url, %reason, path = %path.display(), "the Hub is out of reach; using the cached copy");
            }
            return cached.map_err(|_| HubError::Transport { url, reason });
        }
        other => other?,
    };
    let names: Vec<&str> = listing
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .collect();
    let choice = select::choose(&model.repo, &names, model.quant.as_deref())?;
    let dir = repo_dir(&opts.cache, &model.repo);
    let snapshot = dir.join("snapshots").join(&listing.sha);
    let _lock = RepoLock::take(&dir, &model.repo)?;
    for name in &choice.files {
        let Some(sib) = listing.siblings.iter().find(|s| &s.rfilename == name) else {
            continue;
        };
        if whole(&snapshot.join(name), sib) {
            continue;
        }
        let got = repo
            .download_with_progress(name, Reporter::new(name))
            .map_err(|e| api_error(e, name, model, opts))?;
        if !got.starts_with(&snapshot) {
            return Err(HubError::Moved {
                repo: model.repo.clone(),
            });
        }
        check(&got, sib, model)?;
    }
    Ok(match choice.entry {
        Entry::Folder => snapshot,
        Entry::File(f) => snapshot.join(f),
    })
}

/// The repository's files at the revision, with sizes and hashes.
fn list(repo: &ApiRepo, model: &ModelRef, opts: &Options) -> Result<Listing, HubError> {
    let req = repo.info_request().query("blobs", "true");
    let url = req.url().to_string();
    let resp = req.call().map_err(|e| http_error(e, &url, model, opts))?;
    let mut body = Vec::new();
    resp.into_reader()
        .take(MAX_LISTING_BYTES + 1)
        .read_to_end(&mut body)
        .map_err(|e| HubError::Transport {
            url: url.clone(),
            reason: e.to_string(),
        })?;
    let bad = |reason: String| HubError::Listing {
        repo: model.repo.clone(),
        reason,
    };
    if body.len() as u64 > MAX_LISTING_BYTES {
        return Err(bad(format!("longer than {MAX_LISTING_BYTES} bytes")));
    }
    let listing: Listing = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    // The commit names a folder of the cache.
    if !is_commit(&listing.sha) {
        return Err(bad(format!("`{}` is not a commit id", listing.sha)));
    }
    Ok(listing)
}

/// Whether `path` holds the file the listing describes, by size: a file is only linked
/// into a snapshot once it is whole and checked, so the hash is not read again.
fn whole(path: &Path, sib: &Sibling) -> bool {
    match (std::fs::metadata(path), sib.size()) {
        (Ok(m), Some(size)) => m.len() == size,
        _ => false,
    }
}

/// Checks a new download against the listing's size and hash; a file that fails is
/// deleted (blob and link), so the next start fetches it anew.
fn check(path: &Path, sib: &Sibling, model: &ModelRef) -> Result<(), HubError> {
    let io = |source| HubError::Io {
        path: path.to_path_buf(),
        source,
    };
    let blob = std::fs::canonicalize(path).map_err(io)?;
    let bytes_len = std::fs::metadata(&blob).map_err(io)?.len();
    let failure = if sib.size().is_some_and(|s| s != bytes_len) {
        Some((
            "the size",
            sib.size().unwrap_or(0).to_string(),
            bytes_len.to_string(),
        ))
    } else if let Some(lfs) = &sib.lfs {
        let got = digest::<sha2::Sha256>(&blob, None).map_err(io)?;
        (got != lfs.sha256.to_ascii_lowercase()).then(|| ("the SHA-256", lfs.sha256.clone(), got))
    } else if let Some(id) = &sib.blob_id {
        let got = digest::<sha1::Sha1>(&blob, Some(bytes_len)).map_err(io)?;
        (got != id.to_ascii_lowercase()).then(|| ("the git blob id", id.clone(), got))
    } else {
        None
    };
    let Some((what, expected, got)) = failure else {
        return Ok(());
    };
    std::fs::remove_file(&blob).map_err(io)?;
    std::fs::remove_file(path).map_err(io)?;
    Err(HubError::Corrupt {
        repo: model.repo.clone(),
        file: sib.rfilename.clone(),
        what,
        expected,
        got,
    })
}

/// The hex digest of a file; with `git_len`, of git's blob header and the file.
fn digest<D: Digest>(path: &Path, git_len: Option<u64>) -> std::io::Result<String> {
    let mut hasher = D::new();
    if let Some(len) = git_len {
        hasher.update(format!("blob {len}\0").as_bytes());
    }
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// What the Hub's refusal means for the user, from its status and `X-Error-Code`.
pub(crate) fn refusal(
    status: u16,
    code: Option<&str>,
    has_token: bool,
    model: &ModelRef,
    endpoint: &str,
    url: &str,
) -> HubError {
    let repo = model.repo.clone();
    let page = format!("{endpoint}/{}", model.repo);
    match (code, status) {
        (Some("GatedRepo"), _) if has_token => HubError::GatedDenied { repo, page },
        (Some("GatedRepo"), _) => HubError::Gated { repo, page },
        (Some("RevisionNotFound"), _) => HubError::RevisionNotFound {
            repo,
            revision: model.revision.clone(),
        },
        (Some("RepoNotFound"), _) | (None, 404) => HubError::NotFound { repo },
        // The Hub answers an anonymous request for a private or missing repository 401.
        (None, 401) if !has_token => HubError::NotFound { repo },
        (None, 401 | 403) => HubError::BadToken { repo, status },
        _ => HubError::Status {
            url: url.into(),
            status,
        },
    }
}

fn http_error(e: ureq::Error, url: &str, model: &ModelRef, opts: &Options) -> HubError {
    match e {
        ureq::Error::Status(status, resp) => refusal(
            status,
            resp.header("x-error-code"),
            opts.token.is_some(),
            model,
            &opts.endpoint,
            url,
        ),
        ureq::Error::Transport(t) => HubError::Transport {
            url: url.into(),
            reason: t.to_string(),
        },
    }
}

fn api_error(e: ApiError, file: &str, model: &ModelRef, opts: &Options) -> HubError {
    let url = format!(
        "{}/{}/resolve/{}/{file}",
        opts.endpoint, model.repo, model.revision
    );
    match e {
        ApiError::RequestError(e) => http_error(*e, &url, model, opts),
        ApiError::TooManyRetries(e) => api_error(*e, file, model, opts),
        // Our repository lock keeps this process's peers off the blob; another program
        // (huggingface-cli) fetching the same file holds its lock.
        ApiError::LockAcquisition(path) => HubError::Io {
            path,
            source: std::io::Error::other("another program is fetching this file"),
        },
        ApiError::IoError(e) => HubError::Interrupted {
            file: file.into(),
            reason: e.to_string(),
        },
        other => HubError::Protocol {
            file: file.into(),
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16, code: Option<&str>, token: bool) -> HubError {
        let model = ModelRef::parse("meta-llama/Llama-3.2-1B@v2").unwrap();
        refusal(status, code, token, &model, "https://huggingface.co", "u")
    }

    #[test]
    fn the_hubs_refusals_say_what_the_user_must_do() {
        match refused(401, Some("GatedRepo"), false) {
            HubError::Gated { page, .. } => {
                assert_eq!(page, "https://huggingface.co/meta-llama/Llama-3.2-1B")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            refused(403, Some("GatedRepo"), true),
            HubError::GatedDenied { .. }
        ));
        assert!(matches!(
            refused(401, Some("RepoNotFound"), false),
            HubError::NotFound { .. }
        ));
        assert!(matches!(
            refused(401, None, false),
            HubError::NotFound { .. }
        ));
        assert!(matches!(
            refused(404, None, true),
            HubError::NotFound { .. }
        ));
        assert!(matches!(
            refused(401, None, true),
            HubError::BadToken { status: 401, .. }
        ));
        assert!(matches!(
            refused(404, Some("RevisionNotFound"), false),
            HubError::RevisionNotFound { revision, .. } if revision == "v2"
        ));
        assert!(matches!(
            refused(503, None, false),
            HubError::Status { status: 503, .. }
        ));
    }
}
