//! What a model argument names: `org/name`, `org/name@revision`, `org/name:Q4_K_M`, each
//! with an optional `hf://` in front, as vLLM, SGLang and llama.cpp's `-hf` take them.

use crate::limits::{MAX_NAME_PART, MAX_REVISION};
use crate::HubError;

/// A model repository on the Hub and what to take from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit (`main` unless the name says).
    pub revision: String,
    /// For a GGUF repository: the quantization whose file to take (`Q4_K_M`).
    pub quant: Option<String>,
}

impl ModelRef {
    /// Reads `spec` as a Hub name, or says why it is not one.
    pub fn parse(spec: &str) -> Result<Self, HubError> {
        let bad = |why: &str| HubError::BadName {
            spec: spec.into(),
            why: why.into(),
        };
        let rest = spec.strip_prefix("hf://").unwrap_or(spec);
        let (rest, quant) = match rest.rsplit_once(':') {
            Some((head, q)) => {
                if !q.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || q.is_empty() {
                    return Err(bad("a quantization is letters, digits and `_`, as Q4_K_M"));
                }
                (head, Some(q.to_string()))
            }
            None => (rest, None),
        };
        let (repo, revision) = match rest.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (rest, "main"),
        };
        if revision.is_empty() || revision.len() > MAX_REVISION || revision.contains("..") {
            return Err(bad("a revision is a branch, tag or commit"));
        }
        if !revision
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        {
            return Err(bad("a revision is a branch, tag or commit"));
        }
        let Some((org, name)) = repo.split_once('/') else {
            return Err(bad("a Hub name is org/name"));
        };
        if !valid_part(org) || !valid_part(name) {
            return Err(bad(
                "org and name are letters, digits, `-`, `_` and `.`, not starting with `.` or `-`",
            ));
        }
        Ok(Self {
            repo: repo.into(),
            revision: revision.into(),
            quant,
        })
    }

    /// The name the router serves the model as when none is given: the repository and
    /// its quantization, as the user wrote them, without the revision.
    pub fn served_name(&self) -> String {
        match &self.quant {
            Some(q) => format!("{}:{q}", self.repo),
            None => self.repo.clone(),
        }
    }
}

/// One half of `org/name`, as the Hub allows it.
fn valid_part(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= MAX_NAME_PART
        && !part.starts_with(['.', '-'])
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(spec: &str) -> ModelRef {
        ModelRef::parse(spec).unwrap_or_else(|e| panic!("{spec}: {e}"))
    }

    #[test]
    fn names_revisions_and_quantizations_are_read() {
        assert_eq!(
            parsed("Qwen/Qwen3-0.6B"),
            ModelRef {
                repo: "Qwen/Qwen3-0.6B".into(),
                revision: "main".into(),
                quant: None
            }
        );
        let r = parsed("hf://unsloth/Qwen3-8B-GGUF@v1.0:Q4_K_M");
        assert_eq!(r.repo, "unsloth/Qwen3-8B-GGUF");
        assert_eq!(r.revision, "v1.0");
        assert_eq!(r.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!(r.served_name(), "unsloth/Qwen3-8B-GGUF:Q4_K_M");
        assert_eq!(parsed("a/b@refs/pr/3").revision, "refs/pr/3");
    }

    #[test]
    fn paths_and_malformed_names_are_not_hub_names() {
        for spec in [
            "model.gguf",
            "/models/qwen",
            "./models/qwen",
            "../x/y",
            "a/b/c",
            "a/",
            "/b",
            "a/b@",
            "a/b:",
            "a/b@../../etc",
            "a/b:Q4 K",
            "a/b c",
            ".hidden/x",
        ] {
            assert!(
                matches!(ModelRef::parse(spec), Err(HubError::BadName { .. })),
                "{spec}"
            );
        }
        let long = format!("org/{}", "n".repeat(MAX_NAME_PART + 1));
        assert!(ModelRef::parse(&long).is_err());
    }
}
