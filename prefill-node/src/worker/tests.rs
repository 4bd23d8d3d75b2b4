//! The compute thread on the engine's generated tiny model: prompts chunked as the plan
//! says, their caches sent layer by layer, and the same first token as one whole pass.

use engine::testmodel::{write_model, ModelSize, DEFAULT_SEED};

use super::*;

fn model() -> Arc<Model> {
    let dir = std::env::temp_dir().join(format!("prefill-tiny-{}", std::process::id()));
    write_model(&dir, ModelSize::Tiny, candle_core::DType::F32, DEFAULT_SEED)
        .expect("writing the tiny model");
    Arc::new(Model::load(&dir, &candle_core::Device::Cpu).expect("the tiny model"))
}

/// What one prompt's caller holds: its transfer and its answer.
struct Caller {
    transfer: mpsc::UnboundedReceiver<Item>,
    done: oneshot::Receiver<Result<Computed, PrefillError>>,
}

fn job(prompt: Vec<u32>) -> (Job, Caller) {
    let (transfer, transfer_rx) = mpsc::unbounded_channel();
    let (done, done_rx) = oneshot::channel();
    let job = Job {
        prompt,
        sampling: SamplingParams::default(),
        constraint: None,
        top_logprobs: 0,
        n: 1,
        beam: false,
        cache_partition: Vec::new(),
        prompt_logprobs: false,
        resumed: 0,
        enqueued: Instant::now(),
        span: tracing::Span::none(),
        transfer,
        done,
    };
    let caller = Caller {
        transfer: transfer_rx,
        done: done_rx,
    };
    (job, caller)
}

/// The greedy first token of `prompt` from one forward pass over all of it.
fn whole_pass_first(model: &Model, prompt: &[u32]) -> u32 {
    let mut cache = model.new_cache().unwrap();
    let logits = model
        .forward(&mut [SeqInput {
            tokens: prompt,
            cache: &mut cache,
        }])
        .unwrap();
    let row: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
    let best = row
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    best.0 as u32
}

#[test]
fn prompts_run_in_chunks_and_send_every_layer_of_their_cache() {
    let model = model();
    let limits = Limits {
        step_tokens: 8,
        chunk_tokens: 4,
        message_tokens: 3,
        prefix_cache_bytes: 0,
        max_active_tokens: 64,
    };
    let long: Vec<u32> = (1..=10).collect();
    let short = vec![7, 8, 9];
    let (jobs_tx, jobs_rx) = mpsc::channel(4);
    let mut callers = Vec::new();
    for prompt in [long.clone(), short.clone()] {
        let (job, caller) = job(prompt);
        jobs_tx.try_send(job).unwrap();
        callers.push(caller);
    }
    drop(jobs_tx);
    let metrics = Arc::new(PrefillMetrics::default());
    let thread = spawn(Arc::clone(&model), limits, metrics, jobs_rx).unwrap();
    thread
        .join()
        .expect("the compute thread ends once its queue does");

    // Steps of [4, 3], [4], [2]: the short prompt finishes in the first, beside the long.
    for (mut caller, (prompt, batch)) in callers.into_iter().zip([(&long, 1), (&short, 2)]) {
        let computed = caller.done.try_recv().unwrap().expect("computed");
        assert_eq!(computed.batch_size, batch);
        assert_eq!(
            computed.first[0].token,
            whole_pass_first(&model, prompt),
            "chunked prefill picks what one pass over the prompt picks"
        );
        let items: Vec<Item> = std::iter::from_fn(|| caller.transfer.try_recv().ok()).collect();
        let (last, chunks) = items.split_last().unwrap();
        assert!(matches!(last, Item::First(f) if f.tokens.len() == 1));
        for layer in 0..model.kv_layout().n_layers as u32 {
            let spans: Vec<(u32, u32)> = chunks
                .iter()
                .filter_map(|i| match i {
                    Item::Chunk(c) if c.layer == layer => Some((c.start, c.len)),
                    _ => None,
                })
                .collect();
            let mut next = 0;
            for (start, len) in spans {
                assert_eq!(start, next, "layer {layer} is sent in order, without gaps");
                assert!((1..=3).contains(&len), "at most message_tokens a message");
                next += len;
            }
            assert_eq!(next as usize, prompt.len(), "layer {layer} is sent whole");
        }
    }
}
