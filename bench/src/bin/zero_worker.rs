//! Zero-compute backends for the router-overhead bench (`bench::zero`): a prefill node, a
//! decode node or an OpenAI-style HTTP server that run no model. Bench only.

use std::path::PathBuf;

use bench::zero::{serve_grpc, ZeroModel, ZeroRole};
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
#[command(name = "zero-worker")]
struct Args {
    /// Address to listen on.
    #[arg(long)]
    listen: String,
    /// Model folder or GGUF file: its KV layout and tokenizer (no weights are loaded).
    #[arg(long)]
    model: PathBuf,
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Tandem's prefill gRPC service.
    Prefill,
    /// Tandem's decode gRPC service.
    Decode,
    /// An OpenAI-style HTTP server (the backend other routers speak to).
    Openai {
        /// Completion tokens in every answer.
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        /// The model name the answers carry.
        #[arg(long, default_value = "zero")]
        model_name: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = TcpListener::bind(&args.listen).await?;
    match args.role {
        Role::Prefill => {
            serve_grpc(listener, ZeroModel::load(&args.model)?, ZeroRole::Prefill).await?
        }
        Role::Decode => {
            serve_grpc(listener, ZeroModel::load(&args.model)?, ZeroRole::Decode).await?
        }
        Role::Openai { tokens, model_name } => {
            let path = args.model.display().to_string();
            bench::zero::serve_openai(listener, &model_name, &path, tokens).await?
        }
    }
    Ok(())
}
