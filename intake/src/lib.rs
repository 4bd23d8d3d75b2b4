//! What a worker node takes in. Both nodes receive a request of the same contract (the
//! decode node's `GenerateRequest`, the prefill node's `PrefillRequest`) and must refuse
//! the same things before they take memory or compute for it: the contract's limits
//! (`proto::limits`), what the model bounds (its vocabulary, its context), and sampling
//! settings or a grammar that would make a step cost more or a logit NaN. The checks live
//! here once, so that the two nodes cannot drift apart; each node maps [`RequestError`]
//! into its own error, and from there to a gRPC status in one place.

mod check;
pub mod grammars;
pub mod sampling;

pub use check::{Asked, Checked, Intake, ModelBounds, RequestError, Sampler};
pub use grammars::Grammars;
pub use sampling::SamplingError;
