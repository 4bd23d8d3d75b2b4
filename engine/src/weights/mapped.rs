//! A Hugging Face folder's safetensors files, mapped, with where each tensor lies: a
//! tensor is converted from its pages, or used where it lies ([`DenseMatrices::InPlace`]),
//! its bytes then a slice of the mapping that lives as long as the model.
//!
//! [`DenseMatrices::InPlace`]: super::DenseMatrices::InPlace

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensors};

use crate::error::{EngineError, Result};

/// Where one tensor lies.
struct Located {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// The mapped files and their tensors by name.
pub struct MappedFolder {
    files: Vec<Bytes>,
    tensors: HashMap<String, Located>,
}

impl MappedFolder {
    /// Maps each of `paths` and reads its header: refused where a header is not
    /// safetensors' (its tensors past the file's end among them) or two files name one
    /// tensor. `populate` reads every page in now, for files whose tensors are used where
    /// they lie, so that the first request does not fault them in.
    pub(super) fn open(dir: &Path, paths: &[PathBuf], populate: bool) -> Result<Self> {
        let mut folder = Self {
            files: Vec::with_capacity(paths.len()),
            tensors: HashMap::new(),
        };
        for path in paths {
            let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
            let mut options = memmap2::MmapOptions::new();
            if populate {
                options.populate();
            }
            // SAFETY: the mapping is undefined behaviour if a file changes while mapped. A
            // model's files are not written while a node serves them (one replaced by
            // renaming another over it leaves this mapping as it was); a file cut short in
            // place would fault the reads past its new end, as it would llama.cpp's mapping.
            let map = unsafe { options.map(&file) };
            let map = map.map_err(|e| EngineError::io(path, e))?;
            let map = Bytes::from_owner(map);
            let (header, metadata) = SafeTensors::read_metadata(&map)
                .map_err(|e| EngineError::invalid_model(path, e.to_string()))?;
            folder.add(dir, folder.files.len(), 8 + header, &metadata)?;
            folder.files.push(map);
        }
        Ok(folder)
    }

    /// File `file`'s tensors, its data starting at byte `start`.
    fn add(&mut self, dir: &Path, file: usize, start: usize, metadata: &Metadata) -> Result<()> {
        for (name, info) in metadata.tensors() {
            let (from, to) = info.data_offsets;
            let located = Located {
                file,
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: start + from..start + to,
            };
            if self.tensors.insert(name.clone(), located).is_some() {
                let reason = format!("two files hold the tensor {name}");
                return Err(EngineError::invalid_model(dir, reason));
            }
        }
        Ok(())
    }

    /// Every tensor's name.
    pub(super) fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, over its pages.
    pub(super) fn view(&self, name: &str) -> Option<TensorView<'_>> {
        let t = self.tensors.get(name)?;
        let data = &self.files[t.file][t.bytes.clone()];
        // The header was validated when the file was opened: the range holds the shape's
        // values of the type.
        TensorView::new(t.dtype, t.shape.clone(), data).ok()
    }

    /// The bytes of tensor `name`, a slice of the mapping.
    pub(super) fn bytes(&self, name: &str) -> Option<Bytes> {
        let t = self.tensors.get(name)?;
        Some(self.files[t.file].slice(t.bytes.clone()))
    }
}

#[cfg(test)]
mod tests {
    use safetensors::tensor::TensorView;

    use super::*;

    fn write(path: &Path, names: &[&str]) {
        let data = [0u8; 8];
        let views: Vec<(&str, TensorView<'_>)> = names
            .iter()
            .map(|&n| (n, TensorView::new(Dtype::BF16, vec![2, 2], &data).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-mapped-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_tensor_is_a_slice_of_its_file_and_two_files_may_not_both_name_it() {
        let dir = scratch("shards");
        let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
        write(&a, &["x", "y"]);
        write(&b, &["z"]);
        let folder = MappedFolder::open(&dir, &[a.clone(), b], false).unwrap();
        let file = std::fs::read(&a).unwrap();
        let y = folder.bytes("y").unwrap();
        let at = file.len() - 8;
        assert_eq!(&file[at..], &y[..], "y is the last 8 bytes of its file");
        assert_eq!(folder.view("z").unwrap().shape(), [2, 2]);
        assert!(folder.view("w").is_none());
        let c = dir.join("c.safetensors");
        write(&c, &["y"]);
        let twice = MappedFolder::open(&dir, &[a, c], true).err().unwrap();
        assert!(
            twice.to_string().contains("two files hold the tensor y"),
            "{twice}"
        );
    }

    #[test]
    fn a_file_cut_short_is_refused_before_any_tensor_is_used() {
        let dir = scratch("cut");
        let a = dir.join("a.safetensors");
        write(&a, &["x"]);
        let bytes = std::fs::read(&a).unwrap();
        std::fs::write(&a, &bytes[..bytes.len() - 1]).unwrap();
        let cut = MappedFolder::open(&dir, &[a], false).err().unwrap();
        assert!(matches!(cut, EngineError::InvalidModel { .. }), "{cut}");
    }
}
