//! How far loading a model has come, for the nodes to report while large weights load.

use std::fmt;

/// One step of loading a model's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadStep {
    /// `done` of the model's `layers` layers built (read from a GGUF file, or converted).
    LayerBuilt { done: usize, layers: usize },
}

impl LoadStep {
    /// Whether the step is worth a log line: the layers at each tenth of the way and the
    /// last, so that a model of any depth logs about ten lines.
    pub fn worth_reporting(&self) -> bool {
        match *self {
            Self::LayerBuilt { done, layers } => {
                done == layers || done * 10 / layers != (done - 1) * 10 / layers
            }
        }
    }
}

/// Logs the steps worth a line (see [`LoadStep::worth_reporting`]): what a node passes to
/// [`crate::load_reporting`].
pub fn log(step: LoadStep) {
    if step.worth_reporting() {
        tracing::info!(%step, "loading the model");
    }
}

impl fmt::Display for LoadStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LayerBuilt { done, layers } => write!(f, "built layer {done} of {layers}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(layers: usize) -> Vec<usize> {
        (1..=layers)
            .filter(|&done| LoadStep::LayerBuilt { done, layers }.worth_reporting())
            .collect()
    }

    #[test]
    fn layers_are_reported_at_each_tenth_and_the_last() {
        assert_eq!(reported(32), [4, 7, 10, 13, 16, 20, 23, 26, 29, 32]);
        assert_eq!(reported(3), [1, 2, 3]);
        let step = LoadStep::LayerBuilt {
            done: 4,
            layers: 32,
        };
        assert_eq!(step.to_string(), "built layer 4 of 32");
    }
}
