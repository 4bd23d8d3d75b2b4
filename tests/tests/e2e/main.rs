//! End-to-end tests: real router, prefill and decode processes on localhost, real HTTP.

mod api;
mod auth;
mod beam;
mod bounds;
mod cluster;
mod conformance;
mod echo;
mod errors;
mod failures;
mod fuzz;
mod http_bounds;
mod kv_budget;
mod kv_garbage;
mod kv_hostile;
mod lm_eval;
mod load;
mod openai_sdk;
mod params;
mod pd_vs_colocated;
mod prefill;
mod request_ids;
mod security;
mod streaming;
mod tools;
mod transport;
mod usage;
