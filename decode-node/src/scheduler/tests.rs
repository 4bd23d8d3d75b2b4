//! The scheduler's plans applied on the engine's generated tiny model: which requests a
//! step takes, and what starting one gives its sequences.

use std::sync::OnceLock;

use engine::testmodel::{write_model, ModelSize, DEFAULT_SEED};

use super::*;
use crate::ended::Live;

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("decode-tiny-{}", std::process::id()));
        write_model(&dir, ModelSize::Tiny, candle_core::DType::F32, DEFAULT_SEED)
            .expect("writing the tiny model");
        Arc::new(Model::load(&dir, &candle_core::Device::Cpu).expect("the tiny model"))
    }))
}

fn scheduler(max_batch: usize) -> Scheduler {
    Scheduler::new(model(), max_batch, Arc::new(DecodeMetrics::new(16)))
}

/// A colocated request of `n` sequences and what its caller receives.
fn request(
    n: usize,
    max_new: usize,
) -> (
    Admission,
    mpsc::UnboundedReceiver<Result<GenerateEvent, Status>>,
) {
    let (events, rx) = mpsc::unbounded_channel();
    let prompt = vec![1, 2, 3];
    let admission = Admission {
        span: tracing::Span::none(),
        positions: prompt.len() + max_new + 1,
        prompt,
        sampling: SamplingParams::default(),
        constraint: None,
        top_logprobs: 0,
        n,
        beam_width: 0,
        max_new,
        stop_ids: Vec::new(),
        prompt_logprobs: false,
        resumed: 0,
        ended: Arc::new(Live::default()).register("r", n),
        start: Start::Prefill,
        enqueued: Instant::now(),
        events,
        delayed: false,
        lease: Lease::default(),
    };
    (admission, rx)
}

fn drained(rx: &mut mpsc::UnboundedReceiver<Result<GenerateEvent, Status>>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok())
        .map(|e| e.expect("no error").event.expect("an event"))
        .collect()
}

#[test]
fn the_queue_starts_in_order_while_the_batch_has_room() {
    let mut s = scheduler(4);
    let mut callers = Vec::new();
    for n in [3, 2, 1] {
        let (a, rx) = request(n, 8);
        s.waiting.push_back(a);
        callers.push(rx);
    }
    s.start_waiting();
    assert_eq!(s.batch_len(), 3, "3 + 2 is past the batch of 4");
    assert_eq!(
        s.waiting.len(),
        2,
        "the narrow request waits behind the wide one"
    );
    assert!(s.waiting.iter().all(|a| a.delayed));
    let first = drained(&mut callers[0]);
    assert_eq!(first.len(), 3, "one first token per sequence: {first:?}");
    assert!(first
        .iter()
        .all(|e| matches!(e, Event::Token(t) if t.from_prefill)));
    assert!(drained(&mut callers[1]).is_empty());

    s.step();
    assert_eq!(drained(&mut callers[0]).len(), 3, "a token per sequence");
    s.running.clear();
    s.start_waiting();
    assert_eq!(
        (s.batch_len(), s.waiting.len()),
        (3, 0),
        "both fit once it left"
    );
}

#[test]
fn a_request_with_nothing_to_produce_finishes_at_once() {
    let mut s = scheduler(4);
    let (a, mut rx) = request(2, 0);
    s.admit(a);
    assert_eq!(s.batch_len(), 0);
    let finishes: Vec<_> = drained(&mut rx)
        .into_iter()
        .map(|e| match e {
            Event::Finish(f) => (f.choice, f.reason),
            other => panic!("{other:?}"),
        })
        .collect();
    let length = FinishReason::Length as i32;
    assert_eq!(finishes, [(0, length), (1, length)]);
}

#[test]
fn transferred_first_tokens_are_checked_before_they_start() {
    let mut s = scheduler(4);
    let vocab = model().config().vocab_size as u32;
    let token = |t| Sampled {
        token: t,
        logprob: 0.0,
        top: Vec::new(),
    };
    for (first, says) in [
        (vec![token(1)], "1 first tokens arrived for 2 sequences"),
        (vec![token(1), token(vocab)], "is outside the vocabulary"),
    ] {
        let (mut a, mut rx) = request(2, 4);
        let mut cache = model().new_cache().unwrap();
        let prompt = a.prompt.clone();
        model()
            .forward(&mut [SeqInput {
                tokens: &prompt,
                cache: &mut cache,
            }])
            .unwrap();
        a.start = Start::Transferred {
            cache,
            first_tokens: first,
        };
        s.admit(a);
        assert_eq!(s.batch_len(), 0);
        let refused = rx.try_recv().unwrap().unwrap_err();
        assert!(refused.message().contains(says), "{refused:?}");
    }
}
