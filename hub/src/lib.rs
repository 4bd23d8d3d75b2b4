//! Models named on the Hugging Face Hub, as every serving stack takes them: `--model
//! Qwen/Qwen3-0.6B`, `org/name@revision`, `org/name:Q4_K_M` for one GGUF file of a
//! repository. Files land in the cache layout `huggingface_hub` uses (`HF_HOME`), so a
//! model fetched by either is found by the other.
//!
//! The transfer is the `hf-hub` crate's (its cache layout, resumed `.sync.part` files, blob
//! locks); around it this crate chooses the files, checks each new one against the size and
//! hash the Hub lists, keeps processes on one host from fetching one repository twice, maps
//! the Hub's refusals to what a user must do, reports progress and works offline.

mod cache;
mod error;
mod fetch;
pub mod limits;
mod name;
mod progress;
mod select;

use std::path::{Path, PathBuf};

pub use error::HubError;
pub use name::ModelRef;
pub use select::{choose, Choice, Entry};

/// What `--help` of every binary that takes a Hub name says of the environment it reads
/// ([`Options::from_env`]); the deploy checks take the names from there.
pub const ENV_HELP: &str = "\
Environment (Hub names, as huggingface_hub reads it):
  HF_HOME         the cache's parent and the login token's folder [default: ~/.cache/huggingface]
  HF_HUB_CACHE    the cache itself [default: $HF_HOME/hub]
  HF_ENDPOINT     the Hub's address, or a mirror's [default: https://huggingface.co]
  HF_TOKEN        the token for gated and private repositories [default: $HF_HOME/token]
  HF_TOKEN_PATH   the token file to read when HF_TOKEN is unset
  HF_HUB_OFFLINE  1: use the cache only, never the network";

/// Where and how to fetch: `huggingface_hub`'s environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The Hub's address (`HF_ENDPOINT`, default `https://huggingface.co`).
    pub endpoint: String,
    /// The cache's `hub` folder (`HF_HUB_CACHE`, else `$HF_HOME/hub`).
    pub cache: PathBuf,
    /// `HF_TOKEN`, else the token file `huggingface-cli login` writes.
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE`: use the cache only.
    pub offline: bool,
    /// Retries of a broken transfer within one start (each resumes).
    pub retries: usize,
}

impl Options {
    /// From this process's environment.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        let mut opts = Self::from_vars(var);
        if opts.token.is_none() {
            let file = std::env::var_os("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .unwrap_or_else(|| hf_home(var).join("token"));
            opts.token = std::fs::read_to_string(file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty());
        }
        opts
    }

    /// From variables as `var` gives them (no token file read).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = hf_home(&var);
        let truthy =
            |v: String| ["1", "on", "yes", "true"].contains(&v.to_ascii_lowercase().as_str());
        Self {
            endpoint: set("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            cache: set("HF_HUB_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join("hub")),
            token: set("HF_TOKEN"),
            offline: set("HF_HUB_OFFLINE").is_some_and(truthy),
            retries: limits::DOWNLOAD_RETRIES,
        }
    }
}

/// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`: the
/// cache's parent, and where `huggingface-cli login` writes the token.
fn hf_home(var: impl Fn(&str) -> Option<String>) -> PathBuf {
    let set = |k: &str| var(k).filter(|v| !v.is_empty());
    set("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let cache = set("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(set("HOME").unwrap_or_default()).join(".cache"));
        cache.join("huggingface")
    })
}

/// A model argument made into what the engine opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// A folder or GGUF file on this machine.
    pub path: PathBuf,
    /// For a Hub name, the name to serve the model as (`org/name`, `org/name:QUANT`).
    pub served_name: Option<String>,
}

/// `arg` as a path where one exists here, else as a Hub name: found in the cache offline,
/// else fetched (what is already cached and whole is not fetched again).
pub fn resolve(arg: &Path, opts: &Options) -> Result<Resolved, HubError> {
    if arg.exists() {
        return Ok(Resolved {
            path: arg.to_path_buf(),
            served_name: None,
        });
    }
    let spec = arg.to_str().ok_or_else(|| HubError::BadName {
        spec: arg.display().to_string(),
        why: "not UTF-8".into(),
    })?;
    let model = ModelRef::parse(spec)?;
    let path = if opts.offline {
        cache::find(&model, opts)?
    } else {
        fetch::fetch(&model, opts)?
    };
    Ok(Resolved {
        path,
        served_name: Some(model.served_name()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn opts(vars: &[(&str, &str)]) -> Options {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Options::from_vars(|k| vars.get(k).cloned())
    }

    #[test]
    fn the_environment_is_read_as_huggingface_hub_reads_it() {
        let o = opts(&[("HOME", "/home/u")]);
        assert_eq!(o.cache, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(o.endpoint, "https://huggingface.co");
        assert!(!o.offline && o.token.is_none());
        let o = opts(&[
            ("HF_HOME", "/data/hf"),
            ("HF_ENDPOINT", "http://mirror:8080/"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_TOKEN", "hf_x"),
        ]);
        assert_eq!(o.cache, PathBuf::from("/data/hf/hub"));
        assert_eq!(o.endpoint, "http://mirror:8080");
        assert!(o.offline);
        assert_eq!(o.token.as_deref(), Some("hf_x"));
        let o = opts(&[
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "0"),
            ("HF_TOKEN", ""),
        ]);
        assert_eq!(o.cache, PathBuf::from("/c"));
        assert!(!o.offline && o.token.is_none());
    }

    #[test]
    fn an_existing_path_is_taken_as_it_is() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let got = resolve(here, &opts(&[("HF_HUB_OFFLINE", "1")])).unwrap();
        assert_eq!(got.path, here);
        assert_eq!(got.served_name, None);
    }
}
