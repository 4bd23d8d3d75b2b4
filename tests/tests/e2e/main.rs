//! End-to-end tests: real router, prefill and decode processes on localhost, real HTTP.

mod api;
mod auth;
mod beam;
mod errors;
mod openai_sdk;
mod params;
mod pd_vs_colocated;
mod streaming;
mod tools;
mod usage;
