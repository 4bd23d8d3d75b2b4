//! Which of a repository's files a model needs: a decision on the file names alone, the
//! same online (from the Hub's listing) and offline (from the cached snapshot).

use crate::limits::LISTED_CHOICES;
use crate::HubError;

/// The files the engine reads from a Hugging Face folder besides its weights. A folder
/// without the first three does not load; the others are read where present.
const FOLDER_FILES: [&str; 5] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];

/// The quantization llama.cpp's `-hf` takes from a GGUF repository named without one.
const DEFAULT_QUANT: &str = "Q4_K_M";

/// What to fetch and what the model argument then points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Repository paths to fetch, in the listing's order.
    pub files: Vec<String>,
    /// What the engine is given.
    pub entry: Entry,
}

/// The model as the engine opens it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// The snapshot folder (safetensors and their configs).
    Folder,
    /// One GGUF file, by its repository path.
    File(String),
}

/// Chooses from `names` (a repository's file paths) for `quant`.
/// A name that is not a plain relative path (`..`, a leading `/`) is never taken: the
/// listing comes from the network and each name becomes a path in the cache.
pub fn choose(repo: &str, names: &[&str], quant: Option<&str>) -> Result<Choice, HubError> {
    let names: Vec<&str> = names.iter().copied().filter(|n| plain(n)).collect();
    let names = names.as_slice();
    if quant.is_none() {
        if let Some(choice) = folder(names) {
            return Ok(choice);
        }
    }
    let ggufs: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.ends_with(".gguf") && !base(n).starts_with("mmproj"))
        .collect();
    if ggufs.is_empty() {
        return Err(match quant {
            Some(q) => HubError::NoSuchQuant {
                repo: repo.into(),
                quant: q.into(),
                available: Vec::new(),
            },
            None => HubError::NoWeights {
                repo: repo.into(),
                files: listed(names),
            },
        });
    }
    let wanted = quant.unwrap_or(DEFAULT_QUANT);
    let matching: Vec<&str> = ggufs
        .iter()
        .copied()
        .filter(|n| tags(n).any(|t| t.eq_ignore_ascii_case(wanted)))
        .collect();
    let file = match (matching.as_slice(), quant) {
        ([one], _) => *one,
        ([], None) if ggufs.len() == 1 => ggufs[0],
        ([], _) => {
            return Err(HubError::NoSuchQuant {
                repo: repo.into(),
                quant: wanted.into(),
                available: listed(&ggufs),
            })
        }
        (many, _) => {
            return Err(if many.iter().any(|n| is_split(n)) {
                HubError::SplitGguf {
                    repo: repo.into(),
                    files: listed(many),
                }
            } else {
                HubError::AmbiguousQuant {
                    repo: repo.into(),
                    files: listed(many),
                }
            })
        }
    };
    if is_split(file) {
        return Err(HubError::SplitGguf {
            repo: repo.into(),
            files: vec![file.into()],
        });
    }
    Ok(Choice {
        files: vec![file.into()],
        entry: Entry::File(file.into()),
    })
}

/// A transformers folder: its configs and its `model.safetensors` or
/// `model-0000i-of-0000n.safetensors` shards. Other safetensors (Mistral's
/// `consolidated.safetensors`, adapters, `original/`) hold the same weights in another
/// layout and are not fetched.
fn folder(names: &[&str]) -> Option<Choice> {
    let weights = |n: &str| n == "model.safetensors" || is_shard(n);
    if !names.contains(&"config.json") || !names.iter().any(|n| weights(n)) {
        return None;
    }
    let files = names
        .iter()
        .filter(|n| weights(n) || FOLDER_FILES.contains(n))
        .map(|n| n.to_string())
        .collect();
    Some(Choice {
        files,
        entry: Entry::Folder,
    })
}

/// `model-00001-of-00004.safetensors`, at the top of the repository.
fn is_shard(name: &str) -> bool {
    let Some(mid) = name
        .strip_prefix("model-")
        .and_then(|n| n.strip_suffix(".safetensors"))
    else {
        return false;
    };
    numbered_of(mid)
}

/// `00001-of-00004`.
fn numbered_of(s: &str) -> bool {
    let digits = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit());
    matches!(s.split_once("-of-"), Some((i, n)) if digits(i) && digits(n))
}

/// A file of a GGUF split by `llama-gguf-split` (`…-00001-of-00003.gguf`).
fn is_split(name: &str) -> bool {
    let stem = name.trim_end_matches(".gguf");
    stem.len() > 15
        && stem.is_char_boundary(stem.len() - 14)
        && numbered_of(&stem[stem.len() - 14..])
}

/// A relative path of plain names.
fn plain(name: &str) -> bool {
    !name.is_empty()
        && !name.contains('\\')
        && name
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

/// The file name without its folder.
fn base(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// The words of a GGUF file's name, where its quantization is one (`Qwen3-8B-Q4_K_M`).
fn tags(name: &str) -> impl Iterator<Item = &str> {
    base(name).trim_end_matches(".gguf").split(['-', '.'])
}

/// At most `LISTED_CHOICES` names, for a message.
fn listed(names: &[&str]) -> Vec<String> {
    names
        .iter()
        .take(LISTED_CHOICES)
        .map(|n| n.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3: [&str; 9] = [
        ".gitattributes",
        "LICENSE",
        "README.md",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];

    #[test]
    fn a_transformers_folder_takes_its_configs_and_weights() {
        let c = choose("Qwen/Qwen3-0.6B", &QWEN3, None).unwrap();
        assert_eq!(c.entry, Entry::Folder);
        assert_eq!(
            c.files,
            [
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json"
            ]
        );
    }

    #[test]
    fn sharded_weights_are_taken_and_other_layouts_left() {
        let names = [
            "config.json",
            "consolidated.safetensors",
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json",
            "original/model.safetensors",
            "params.json",
            "pytorch_model.bin",
            "tokenizer.json",
            "tokenizer_config.json",
        ];
        let c = choose("mistralai/Mistral-7B-Instruct-v0.3", &names, None).unwrap();
        assert_eq!(c.files.len(), 7);
        assert!(!c
            .files
            .iter()
            .any(|f| f.contains("consolidated") || f.contains('/')));
    }

    #[test]
    fn a_gguf_repository_takes_the_named_quantization() {
        let names = [
            "README.md",
            "Qwen3-8B-Q4_K_M.gguf",
            "Qwen3-8B-Q8_0.gguf",
            "Qwen3-8B-UD-Q4_K_XL.gguf",
            "mmproj-F16.gguf",
        ];
        let pick = |q| choose("unsloth/Qwen3-8B-GGUF", &names, q).unwrap().entry;
        assert_eq!(pick(Some("q8_0")), Entry::File("Qwen3-8B-Q8_0.gguf".into()));
        assert_eq!(
            pick(Some("Q4_K_XL")),
            Entry::File("Qwen3-8B-UD-Q4_K_XL.gguf".into())
        );
        assert_eq!(pick(None), Entry::File("Qwen3-8B-Q4_K_M.gguf".into()));
        match choose("unsloth/Qwen3-8B-GGUF", &names, Some("Q2_K")) {
            Err(HubError::NoSuchQuant { available, .. }) => assert_eq!(available.len(), 3),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_quantization_in_a_transformers_repository_is_refused() {
        assert!(matches!(
            choose("Qwen/Qwen3-0.6B", &QWEN3, Some("Q4_K_M")),
            Err(HubError::NoSuchQuant { .. })
        ));
    }

    #[test]
    fn a_lone_gguf_is_taken_and_splits_and_ties_are_refused() {
        let one = ["smollm2-135m-instruct-q4_1.gguf"];
        assert_eq!(
            choose("a/b", &one, None).unwrap().files,
            ["smollm2-135m-instruct-q4_1.gguf"]
        );
        let split = [
            "big-Q4_K_M-00001-of-00002.gguf",
            "big-Q4_K_M-00002-of-00002.gguf",
        ];
        assert!(matches!(
            choose("a/b", &split, None),
            Err(HubError::SplitGguf { .. })
        ));
        let tie = ["a/m-Q4_K_M.gguf", "b/m-Q4_K_M.gguf"];
        assert!(matches!(
            choose("a/b", &tie, None),
            Err(HubError::AmbiguousQuant { .. })
        ));
    }

    #[test]
    fn names_that_climb_out_of_the_snapshot_are_never_taken() {
        let names = [
            "../../escape-Q4_K_M.gguf",
            "/abs-Q4_K_M.gguf",
            "ok/x-Q8_0.gguf",
        ];
        assert!(matches!(
            choose("a/b", &names, Some("Q4_K_M")),
            Err(HubError::NoSuchQuant { available, .. }) if available == ["ok/x-Q8_0.gguf"]
        ));
    }

    #[test]
    fn a_repository_without_loadable_weights_is_refused() {
        let names = ["config.json", "pytorch_model.bin", "tokenizer.json"];
        match choose("gpt2/old", &names, None) {
            Err(HubError::NoWeights { files, .. }) => assert_eq!(files.len(), 3),
            other => panic!("{other:?}"),
        }
    }
}
