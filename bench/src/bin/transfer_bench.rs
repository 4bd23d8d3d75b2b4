//! KV transfer against the wire: a real decode node receives whole KV caches of 128 to 4096
//! tokens on its KV data plane on loopback (the prefill node's client and chunk sizes, layer
//! by layer), timed from the first message to the acknowledgement, next to the TCP loopback
//! bandwidth measured in the same run. Each cache is then claimed and freed, as in service.
//! With `--mtls`, a second decode node takes the same transfers over mutual TLS, dialed the
//! way a prefill node dials, so TLS's cost is a ratio from one run. With `--ttft`, a PD
//! cluster serves prompts of the same lengths, and the prefill node's own clock says how
//! much of each TTFT the transfer took after the compute ended.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use e2e::{bin, free_port, metric, scrape, Cluster, Mode, Proc};
use kvwire::Item;
use proto::v1::decode_client::DecodeClient;
use proto::v1::{FirstTokens, GenerateRequest, KvHeader, Token};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Parser)]
#[command(name = "transfer-bench")]
struct Args {
    /// Model folder or GGUF file: its KV layout sets the bytes per token.
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths in tokens, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128,256,512,1024,2048,4096"
    )]
    tokens: Vec<usize>,
    /// Transfers per length; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// K (and V) bytes per message, as the prefill node's --transfer-chunk-bytes.
    #[arg(long, default_value_t = 1 << 20)]
    chunk_bytes: usize,
    /// Also time every transfer over mutual TLS (certificates made for the run).
    #[arg(long)]
    mtls: bool,
    /// Also serve prompts of these lengths through a PD cluster and report the transfer's
    /// share of TTFT.
    #[arg(long)]
    ttft: bool,
    /// Requests per length for `--ttft`; medians are reported.
    #[arg(long, default_value_t = 3)]
    ttft_requests: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A decode node's address, a KV client for it, and its gRPC service to claim caches.
struct Target {
    addr: String,
    client: kvwire::Client,
    decode: DecodeClient<runtime::Channel>,
}

/// A decode node on a free port, and a KV client for it (over mutual TLS with `tls`).
async fn decode_node(
    model: &std::path::Path,
    tls: Option<(&e2e::pki::Pki, &std::path::Path)>,
) -> anyhow::Result<(Proc, Target)> {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut args = vec![
        "--model".into(),
        model.display().to_string(),
        "--listen".into(),
        addr.clone(),
    ];
    let mut client_tls = None;
    if let Some((pki, ca)) = tls {
        args.extend(
            pki.leaf_as(Some("decode"), "decode", e2e::pki::Validity::Good)
                .mtls_args(ca),
        );
        let me = pki.leaf_as(Some("prefill"), "prefill", e2e::pki::Validity::Good);
        let files = tls::ClientFiles {
            ca: ca.to_path_buf(),
            identity: Some((me.cert, me.key)),
            alpn: vec![b"h2".to_vec()],
        };
        client_tls = Some(tls::ClientTls::load(files, None)?);
    }
    let tag = if tls.is_some() { "mtls" } else { "plain" };
    let proc = Proc::spawn(
        &bin("tandem-decode"),
        &args,
        &format!("transfer-bench-{tag}"),
    );
    let dialer = runtime::Dialer {
        connect_timeout: Duration::from_secs(1),
        tls: client_tls.clone(),
        max_message: runtime::DEFAULT_MAX_MESSAGE,
        max_age: tls::MAX_CONNECTION_AGE,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut health = DecodeClient::new(dialer.channel(&addr)?);
    while health.health(proto::v1::HealthRequest {}).await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the {tag} decode node did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = kvwire::Client::new(Duration::from_secs(1), client_tls);
    Ok((
        proc,
        Target {
            addr,
            client,
            decode: health,
        },
    ))
}

/// The best time of `repeats` transfers of `tokens` positions to `client`. Each is first
/// reserved with a Generate call, as a router does, for the ticket the transfer presents;
/// the call then decodes nothing past the first token and ends, which frees the cache, so
/// the next lands in memory the node already holds, as on a node in service.
async fn best_transfer(
    target: &Target,
    a: &Args,
    layout: &engine::KvLayout,
    tokens: usize,
    tag: &str,
) -> anyhow::Result<Duration> {
    let mut best = Duration::MAX;
    for r in 0..a.repeats {
        let id = format!("bench-{tag}-{tokens}-{r}");
        let (mut header, items) = transfer(&id, layout, tokens, a.chunk_bytes);
        let mut events = reserve(target, &id, header.tokens.clone()).await?;
        header.ticket = e2e::kv::ticket(&id, &mut events).await;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for m in items {
            tx.send(m).expect("the receiver is held");
        }
        drop(tx);
        let started = Instant::now();
        target
            .client
            .transfer(&target.addr, header, rx)
            .await
            .context("the transfer")?;
        best = best.min(started.elapsed());
        while events
            .message()
            .await
            .context("the Generate call")?
            .is_some()
        {}
    }
    Ok(best)
}

/// Reserves room for a transferred cache of `prompt` with a Generate call for no tokens
/// past the first.
async fn reserve(
    target: &Target,
    id: &str,
    prompt: Vec<u32>,
) -> anyhow::Result<tonic::Streaming<proto::v1::GenerateEvent>> {
    let req = GenerateRequest {
        request_id: id.into(),
        prompt,
        n: 1,
        ..Default::default()
    };
    Ok(target
        .decode
        .clone()
        .generate(req)
        .await
        .context("reserving a cache")?
        .into_inner())
}

/// Loopback TCP bandwidth in bytes/s: 1 GiB through one connection in 1 MiB writes, best
/// of three.
async fn loopback_bandwidth() -> anyhow::Result<f64> {
    const TOTAL: usize = 1 << 30;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let reader = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await?;
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            while got < TOTAL {
                let n = sock.read(&mut buf).await?;
                anyhow::ensure!(n > 0, "the writer closed early");
                got += n;
            }
            Ok::<_, anyhow::Error>(Instant::now())
        });
        let mut sock = tokio::net::TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let buf = vec![7u8; 1 << 20];
        let started = Instant::now();
        for _ in 0..TOTAL / buf.len() {
            sock.write_all(&buf).await?;
        }
        let done = reader.await??;
        best = best.min(done - started);
    }
    Ok(TOTAL as f64 / best.as_secs_f64())
}

/// The header and items of one transfer of `tokens` positions, as a prefill node sends
/// them.
fn transfer(
    id: &str,
    layout: &engine::KvLayout,
    tokens: usize,
    chunk_bytes: usize,
) -> (KvHeader, Vec<Item>) {
    let row = layout.bytes_per_token_layer();
    let per_message = (chunk_bytes / row).max(1);
    let header = KvHeader {
        request_id: id.into(),
        layout: Some(kvwire::convert::layout_to_proto(layout)),
        tokens: (0..tokens as u32).map(|t| t % 100 + 1).collect(),
        ..Default::default()
    };
    let mut out = Vec::new();
    for layer in 0..layout.n_layers as u32 {
        let mut start = 0;
        while start < tokens {
            let len = per_message.min(tokens - start);
            let bytes = vec![0x3fu8; len * row];
            out.push(Item::Chunk(engine::KvChunk {
                layer,
                start: start as u32,
                len: len as u32,
                k: bytes.clone().into(),
                v: bytes.into(),
            }));
            start += len;
        }
    }
    out.push(Item::First(FirstTokens {
        tokens: vec![Token {
            id: 1,
            ..Default::default()
        }],
    }));
    (header, out)
}

/// A text prompt of about `tokens` tokens that no earlier prompt starts like (the prefill
/// node's prefix cache would otherwise skip the compute).
fn prompt_of(tokenizer: &text::Tokenizer, tokens: usize, salt: usize) -> anyhow::Result<String> {
    let words = [
        "tandem", "prefill", "decode", "router", "cache", "token", "layer", "wire",
    ];
    let text: Vec<&str> = (0..tokens * 2).map(|i| words[(i * 7 + salt) % 8]).collect();
    let text = format!("Request {salt}: {}", text.join(" "));
    let ids = tokenizer.encode(&text)?;
    Ok(tokenizer.decode(&ids[..tokens.min(ids.len())], false)?)
}

/// A prefill node's compute time and transfer tail so far, in seconds, from one scrape of
/// its metrics page.
async fn prefill_times(addr: &str) -> anyhow::Result<(f64, f64)> {
    let page = scrape(addr).await;
    let counter = |name: &str| {
        metric(&page, name, "").with_context(|| format!("{name} is missing on {addr}"))
    };
    Ok((
        counter("prefill_step_duration_seconds_sum")?,
        counter("prefill_kv_transfer_tail_duration_seconds_sum")?,
    ))
}

/// Through a PD cluster (router, prefill node, decode node): for each length, the median
/// TTFT a streaming client saw, and the medians of the prefill node's compute time and
/// transfer tail (its last layer to the decode node's acknowledgement) for the same
/// requests, one at a time.
async fn ttft_shares(a: &Args, tokenizer: &text::Tokenizer) -> anyhow::Result<Vec<Value>> {
    let longest = a.tokens.iter().max().copied().unwrap_or(0);
    let (input, seq) = (longest.to_string(), (longest + 16).to_string());
    let limits = ["--max-input-token-len", &input, "--max-seq-len", &seq];
    let cluster = Cluster::start(Mode::Pd, &a.model, &limits).await;
    let prefill = cluster.prefill.clone().expect("a PD cluster");
    let url = format!("{}/v1/completions", cluster.url);
    let body = |prompt: String| {
        json!({"model": "test", "prompt": prompt, "max_tokens": 2, "ignore_eos": true,
            "temperature": 0, "stream": true})
    };
    let warm =
        bench::load::stream_request(&cluster.client, &url, &body(prompt_of(tokenizer, 16, 0)?))
            .await;
    anyhow::ensure!(warm.error.is_none(), "warm-up: {:?}", warm.error);
    println!("| prompt tokens | TTFT ms | compute ms | transfer tail ms | tail % of TTFT |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    let mut salt = 1;
    for &tokens in &a.tokens {
        let (mut ttft, mut compute, mut tail, mut prompt_tokens) = (vec![], vec![], vec![], 0);
        for _ in 0..a.ttft_requests.max(1) {
            salt += 1;
            let before = prefill_times(&prefill).await?;
            let r = bench::load::stream_request(
                &cluster.client,
                &url,
                &body(prompt_of(tokenizer, tokens, salt)?),
            )
            .await;
            anyhow::ensure!(r.error.is_none(), "{tokens} tokens: {:?}", r.error);
            let after = prefill_times(&prefill).await?;
            compute.push(after.0 - before.0);
            tail.push(after.1 - before.1);
            ttft.push(r.ttft);
            prompt_tokens = r.prompt_tokens;
        }
        let (ttft, compute, tail) = (median(ttft), median(compute), median(tail));
        println!(
            "| {prompt_tokens} | {:.1} | {:.1} | {:.2} | {:.2}% |",
            ttft * 1e3,
            compute * 1e3,
            tail * 1e3,
            100.0 * tail / ttft
        );
        rows.push(
            json!({"prompt_tokens": prompt_tokens, "ttft_s": ttft, "compute_s": compute,
            "transfer_tail_s": tail, "tail_share_of_ttft": tail / ttft}),
        );
    }
    Ok(rows)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let text = text::load(&a.model).context("reading the model's config")?;
    let layout = engine::KvLayout::for_model(&text.config, engine::KV_DTYPE);
    let per_token = 2 * layout.n_layers * layout.bytes_per_token_layer();
    let (_plain, plain) = decode_node(&a.model, None).await?;
    let pki_dir = e2e::scratch().join(format!("transfer-bench-pki-{}", free_port()));
    let pki = a.mtls.then(|| e2e::pki::Pki::new(&pki_dir, "bench"));
    let ca = pki.as_ref().map(|p| p.ca());
    let secure = match (&pki, &ca) {
        (Some(p), Some(ca)) => Some(decode_node(&a.model, Some((p, ca))).await?),
        _ => None,
    };
    let wire = loopback_bandwidth().await?;
    println!(
        "model: {}  KV bytes per token: {per_token}",
        a.model.display()
    );
    println!(
        "TCP loopback: {:.2} GB/s (1 GiB, 1 MiB writes, best of 3)",
        wire / 1e9
    );
    let tls_cols = if secure.is_some() {
        " mTLS ms | mTLS GB/s | mTLS / plain |"
    } else {
        ""
    };
    let tls_rule = if secure.is_some() {
        " ---: | ---: | ---: |"
    } else {
        ""
    };
    println!("| tokens | KV MB | transfer ms | GB/s | % of loopback |{tls_cols}");
    println!("| ---: | ---: | ---: | ---: | ---: |{tls_rule}");
    let mut rows = Vec::new();
    for &tokens in &a.tokens {
        let best = best_transfer(&plain, &a, &layout, tokens, "plain").await?;
        let bytes = (tokens * per_token) as f64;
        let rate = bytes / best.as_secs_f64();
        let mut row = json!({"tokens": tokens, "bytes": bytes, "seconds": best.as_secs_f64(),
            "bytes_per_s": rate, "share_of_loopback": rate / wire});
        let mut tls_text = String::new();
        if let Some((_, c)) = &secure {
            let t = best_transfer(c, &a, &layout, tokens, "mtls").await?;
            let r = bytes / t.as_secs_f64();
            tls_text = format!(
                " {:.2} | {:.2} | {:.2} |",
                t.as_secs_f64() * 1e3,
                r / 1e9,
                t.as_secs_f64() / best.as_secs_f64()
            );
            row["mtls_seconds"] = json!(t.as_secs_f64());
            row["mtls_bytes_per_s"] = json!(r);
        }
        println!(
            "| {tokens} | {:.1} | {:.2} | {:.2} | {:.0}% |{tls_text}",
            bytes / 1e6,
            best.as_secs_f64() * 1e3,
            rate / 1e9,
            100.0 * rate / wire
        );
        rows.push(row);
    }
    let ttft = if a.ttft {
        println!();
        ttft_shares(&a, &text.tokenizer).await?
    } else {
        Vec::new()
    };
    if let Some(p) = &a.json {
        let doc = json!({"model": a.model, "kv_bytes_per_token": per_token,
            "loopback_bytes_per_s": wire, "chunk_bytes": a.chunk_bytes, "rows": rows,
            "ttft": ttft});
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
