//! The KV cache travels between engine instances, and batching changes nothing.

use crate::common;

use engine::generate::generate;
use engine::sampling::{self, sample, Context, SamplingParams, TokenMask};
use engine::{KvAssembler, Model, SeqCache, SeqInput, Stager};

fn model() -> Model {
    Model::load(&common::tiny_model_dir(), &common::device()).unwrap()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 101 + 5) % 500)
        .collect()
}

fn seeded() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: 1234,
        ..Default::default()
    }
}

/// Each sequence's tokens with its cache, for one forward pass.
fn inputs<'a>(tokens: &'a [Vec<u32>], caches: &'a mut [SeqCache]) -> Vec<SeqInput<'a>> {
    tokens
        .iter()
        .zip(caches.iter_mut())
        .map(|(t, c)| SeqInput {
            tokens: t,
            cache: c,
        })
        .collect()
}

fn tokens(out: &[engine::Sampled]) -> Vec<u32> {
    out.iter().map(|s| s.token).collect()
}

/// Prefill in one instance, ship the KV as chunks, continue in another: same tokens as one
/// instance running uninterrupted.
#[test]
fn kv_round_trip_between_instances_matches_uninterrupted_decode() {
    round_trip_matches_uninterrupted_decode(&common::tiny_model_dir(), engine::KV_DTYPE);
}

/// The model in `dir` on the tests' device for `kv` ([`common::device_for`]), its caches
/// holding `kv`.
pub(crate) fn model_holding(dir: &std::path::Path, kv: engine::KvDtype) -> Model {
    let mut m = Model::load(dir, &common::device_for(kv)).unwrap();
    m.set_kv_dtype(kv).unwrap();
    m
}

/// [`kv_round_trip_between_instances_matches_uninterrupted_decode`] for the two-layer model
/// in `dir`, its caches holding `kv`.
pub(crate) fn round_trip_matches_uninterrupted_decode(dir: &std::path::Path, kv: engine::KvDtype) {
    let (p_model, d_model) = (model_holding(dir, kv), model_holding(dir, kv));
    let prompt = prompt(45, 1);
    for params in [SamplingParams::default(), seeded()] {
        let mut whole = p_model.new_cache().unwrap();
        let expected = tokens(&generate(&p_model, &mut whole, &prompt, &params, 33, &[]).unwrap());

        // Prefill on "P": the prompt and the first sampled token.
        let mut cache = p_model.new_cache().unwrap();
        let logits = p_model
            .forward(&mut [SeqInput {
                tokens: &prompt,
                cache: &mut cache,
            }])
            .unwrap();
        let first = sample(
            &logits.squeeze(0).unwrap().to_vec1().unwrap(),
            &params,
            &Context::of(&prompt, &[]),
            0,
            0,
        );
        let chunks = cache.export_all(16).unwrap();
        assert_eq!(chunks.len(), 2 * 3, "2 layers x ceil(45/16) chunks");

        // "D" rebuilds the cache from the wire form, in storage sized for the whole
        // sequence as a decode node sizes it, and decodes the rest.
        let reserve = prompt.len() + 64;
        let mut asm = KvAssembler::new(
            d_model.kv_layout(),
            prompt.clone(),
            reserve,
            d_model.device(),
        )
        .unwrap();
        for c in &chunks {
            assert!(!asm.is_complete());
            asm.accept(c).unwrap();
        }
        let mut rebuilt = asm.finish().unwrap();
        assert_eq!(rebuilt.tokens(), prompt.as_slice());
        for (a, b) in rebuilt
            .export_all(64)
            .unwrap()
            .iter()
            .zip(cache.export_all(64).unwrap())
        {
            assert_eq!(a, &b, "rebuilt cache must be bit-identical");
        }
        let mut got = vec![first.token];
        let mut output = vec![first.token];
        for step in 1..33u64 {
            let logits = d_model
                .forward(&mut [SeqInput {
                    tokens: &[*got.last().unwrap()],
                    cache: &mut rebuilt,
                }])
                .unwrap();
            let row: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
            let s = sample(&row, &params, &Context::of(&prompt, &output), step, 0);
            output.push(s.token);
            got.push(s.token);
        }
        assert_eq!(got, expected, "params {params:?}");
    }
}

#[test]
fn assembler_rejects_gaps_bad_sizes_and_incomplete_transfers() {
    let m = model();
    let prompt = prompt(20, 2);
    let mut cache = m.new_cache().unwrap();
    m.forward(&mut [SeqInput {
        tokens: &prompt,
        cache: &mut cache,
    }])
    .unwrap();
    let chunks = cache.export_all(8).unwrap();
    let mut asm = KvAssembler::new(m.kv_layout(), prompt.clone(), 0, m.device()).unwrap();
    assert!(
        asm.accept(&chunks[1]).is_err(),
        "out-of-order chunk accepted"
    );
    let mut short = chunks[0].clone();
    short.k.truncate(short.k.len() - 1);
    assert!(asm.accept(&short).is_err(), "truncated payload accepted");
    let mut wrong_layer = chunks[0].clone();
    wrong_layer.layer = 9;
    assert!(asm.accept(&wrong_layer).is_err(), "unknown layer accepted");
    asm.accept(&chunks[0]).unwrap();
    let err = asm.finish().unwrap_err().to_string();
    assert!(err.contains("incomplete"), "{err}");
}

/// Eight sequences of different lengths decoded together give what each gives alone.
#[test]
fn batched_decode_matches_each_sequence_alone() {
    let m = model();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(3 + i * 7, i as u32)).collect();
    // Greedy, tempered and filtered (top-p; top-k and min-p), tempered alone: on a GPU
    // `generate` decides each row from what `sampling::fetch` brings back (an argmax, a
    // draw, a filtered row's best candidates or the whole row), the loop below samples
    // every row whole on the host.
    let params: Vec<SamplingParams> = (0..8)
        .map(|i| match i % 4 {
            0 => SamplingParams::default(),
            1 => SamplingParams {
                seed: i as u64,
                ..seeded()
            },
            2 => SamplingParams {
                top_k: 20,
                min_p: 0.05,
                seed: i as u64,
                ..seeded()
            },
            _ => SamplingParams {
                temperature: 0.9,
                seed: i as u64,
                ..SamplingParams::default()
            },
        })
        .collect();
    let steps = 24;
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&params)
        .map(|(p, sp)| {
            let mut c = m.new_cache().unwrap();
            tokens(&generate(&m, &mut c, p, sp, steps, &[]).unwrap())
        })
        .collect();

    let mut caches: Vec<_> = prompts.iter().map(|_| m.new_cache().unwrap()).collect();
    let mut outputs: Vec<Vec<u32>> = vec![vec![]; 8];
    // Prefill all eight in one batched call, then decode them together.
    let mut next: Vec<Vec<u32>> = prompts.clone();
    for step in 0..steps {
        let mut batch = inputs(&next, &mut caches);
        let logits = m.forward(&mut batch).unwrap();
        for i in 0..8 {
            let row: Vec<f32> = logits.get(i).unwrap().to_vec1().unwrap();
            let s = sample(
                &row,
                &params[i],
                &Context::of(&prompts[i], &outputs[i]),
                step as u64,
                0,
            );
            outputs[i].push(s.token);
            next[i] = vec![s.token];
        }
    }
    assert_eq!(outputs, alone);
}

/// What `sampling::fetch` brings back of a batch's rows, decided where they lie on a GPU
/// (greedy, tempered, filtered, moved by penalties, a bias or `min_tokens`, masked by a
/// grammar, with and without alternatives) or whole, ends as the host's sampler ends with
/// the whole rows: the same tokens and alternatives.
#[test]
fn rows_fetched_for_sampling_end_as_the_host_sampler_ends() {
    let m = model();
    let mut caches: Vec<_> = (0..6).map(|_| m.new_cache().unwrap()).collect();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(5 + i * 3, i as u32)).collect();
    let logits = m.forward(&mut inputs(&prompts, &mut caches)).unwrap();
    let rows: Vec<Vec<f32>> = logits.to_vec2().unwrap();
    // Rows 3 to 5 also move: a repetition penalty, a logit bias with the presence and
    // frequency penalties, `min_tokens` holding token 7 back.
    let params: Vec<SamplingParams> = (0..6u64)
        .map(|i| SamplingParams {
            temperature: [0.0, 0.9, 1.2][i as usize % 3],
            top_k: [0, 0, 30][i as usize % 3],
            top_p: [1.0, 1.0, 0.9][i as usize % 3],
            seed: i,
            repetition_penalty: if i == 3 { 1.5 } else { 1.0 },
            logit_bias: if i == 4 { vec![(9, 3.0)] } else { vec![] },
            presence_penalty: if i == 4 { 0.5 } else { 0.0 },
            frequency_penalty: if i == 4 { 0.25 } else { 0.0 },
            min_tokens: if i == 5 { 4 } else { 0 },
            held: if i == 5 { vec![7] } else { vec![] },
            ..SamplingParams::default()
        })
        .collect();
    let output = [7u32, 9, 9, 3, 7, 11];
    let tops = [0, 3, 5, 2, 0, 20];
    // Grammars' masks: row 0's leaves out its best token, row 2's the even ones; row 5's
    // allows only its held token 7, so the hold gives way.
    let vocab = rows[0].len();
    let best = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]));
    let best0 = best(&rows[0]).unwrap() as u32;
    let masks: Vec<Option<TokenMask>> = (0..6)
        .map(|i| match i {
            0 => Some(
                (0..vocab as u32)
                    .filter(|&t| t != best0)
                    .collect::<Vec<_>>(),
            ),
            2 => Some((0..vocab as u32).filter(|t| t % 2 == 1).collect()),
            5 => Some(vec![7]),
            _ => None,
        })
        .map(|ids| ids.map(|ids| TokenMask::of(&ids, vocab)))
        .collect();
    for step in 0..6 {
        let cx = |i: usize| Context::of(&prompts[i], &output[..step]).masked(masks[i].as_ref());
        let needs: Vec<_> = (0..6)
            .map(|i| sampling::need(&params[i], cx(i), tops[i], false))
            .collect();
        let fetched = sampling::fetch(&logits, &needs).unwrap();
        for (i, row) in fetched.into_iter().enumerate() {
            let host = |row: &[f32]| sample(row, &params[i], &cx(i), step as u64, tops[i]);
            let got = row.or_sample(host);
            let want = host(&rows[i]);
            assert_eq!(got.token, want.token, "row {i}, step {step}");
            let top = |s: &engine::Sampled| s.top.iter().map(|t| t.token).collect::<Vec<_>>();
            assert_eq!(top(&got), top(&want), "row {i}, step {step}");
            let logprobs = std::iter::once((got.logprob, want.logprob)).chain(
                got.top
                    .iter()
                    .zip(&want.top)
                    .map(|(a, b)| (a.logprob, b.logprob)),
            );
            for (a, b) in logprobs {
                assert!((a - b).abs() < 1e-4, "{got:?} {want:?}");
            }
            match i {
                0 => assert_ne!(got.token, best0, "the best is masked"),
                2 => assert_eq!(got.token % 2, 1, "row 2 keeps to its mask"),
                5 => assert_eq!(got.token, 7, "the hold gives way to the grammar"),
                _ => {}
            }
        }
    }
}

#[test]
fn prefix_reuse_matches_full_prefill() {
    let m = model();
    let full = prompt(40, 3);
    let whole = m.logits_for(&full).unwrap();
    let mut cache = m.new_cache().unwrap();
    m.forward(&mut [SeqInput {
        tokens: &full[..25],
        cache: &mut cache,
    }])
    .unwrap();
    let shared = cache.fork().unwrap();
    let logits = m
        .forward(&mut [SeqInput {
            tokens: &full[25..],
            cache: &mut cache,
        }])
        .unwrap();
    let reused: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
    let max_diff = whole
        .iter()
        .zip(&reused)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff < 1e-4, "max logit difference {max_diff}");
    assert_eq!(
        engine::model::argmax(&whole),
        engine::model::argmax(&reused)
    );

    // The fork kept the 25 positions although the original went on to 40.
    assert_eq!(shared.len(), 25);
    // Truncating back to a shorter prefix and continuing also works.
    let mut cache = shared;
    cache.truncate(10);
    let logits = m
        .forward(&mut [SeqInput {
            tokens: &full[10..],
            cache: &mut cache,
        }])
        .unwrap();
    let again: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
    assert_eq!(engine::model::argmax(&whole), engine::model::argmax(&again));
    assert_eq!(cache.tokens(), full.as_slice());
}

#[test]
fn out_of_range_inputs_are_errors_not_panics() {
    let m = model();
    let mut cache = m.new_cache().unwrap();
    let vocab = m.config().vocab_size as u32;
    assert!(m
        .forward(&mut [SeqInput {
            tokens: &[vocab],
            cache: &mut cache
        }])
        .is_err());
    assert!(m
        .forward(&mut [SeqInput {
            tokens: &[],
            cache: &mut cache
        }])
        .is_err());
    let too_long = vec![1u32; m.config().max_position_embeddings + 1];
    let err = m
        .forward(&mut [SeqInput {
            tokens: &too_long,
            cache: &mut cache,
        }])
        .unwrap_err();
    assert!(
        matches!(err, engine::EngineError::ContextOverflow { .. }),
        "{err}"
    );
    assert!(cache.is_empty(), "a failed call must not change the cache");
}

/// Layers can be shipped as soon as they are computed: chunks exported from the layer hook
/// rebuild the same cache as an export after the call.
#[test]
fn layers_stream_out_while_the_prompt_is_computed() {
    let m = model();
    let prompt = prompt(30, 4);
    let mut cache = m.new_cache().unwrap();
    let mut streamed = Vec::new();
    let mut order = Vec::new();
    m.forward_with(
        &mut [SeqInput {
            tokens: &prompt,
            cache: &mut cache,
        }],
        &mut |layer, batch| {
            order.push(layer);
            let c = &batch[0].cache;
            for start in (0..prompt.len()).step_by(16) {
                let len = 16.min(prompt.len() - start);
                streamed.push(c.export_pending(layer, start, len, prompt.len())?);
            }
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(order, (0..m.config().num_hidden_layers).collect::<Vec<_>>());
    assert_eq!(streamed, cache.export_all(16).unwrap());
    let mut asm = KvAssembler::new(m.kv_layout(), prompt.clone(), 0, m.device()).unwrap();
    for c in &streamed {
        asm.accept(c).unwrap();
    }
    assert_eq!(
        asm.finish().unwrap().export_all(64).unwrap(),
        cache.export_all(64).unwrap()
    );
}

/// A chunk staged from the layer hook (on a GPU: its copy queued behind the layer) holds
/// the layer as it was then: taken only after the whole pass, and after the same positions
/// were written again with another prompt, it is the first prompt's.
#[test]
fn staged_chunks_hold_the_layer_as_it_was_when_staged() {
    let m = model();
    let (first, second) = (prompt(30, 4), prompt(30, 7));
    let stager = Stager::new(m.device());
    let mut cache = m.new_cache().unwrap();
    let mut staged = Vec::new();
    m.forward_with(
        &mut [SeqInput {
            tokens: &first,
            cache: &mut cache,
        }],
        &mut |layer, batch| {
            for start in (0..first.len()).step_by(16) {
                let len = 16.min(first.len() - start);
                staged.push(stager.stage(batch[0].cache, layer, start, len, first.len())?);
            }
            Ok(())
        },
    )
    .unwrap();
    cache.truncate(0);
    m.forward_with(
        &mut [SeqInput {
            tokens: &second,
            cache: &mut cache,
        }],
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let taken: Vec<_> = staged.into_iter().map(|s| s.take().unwrap()).collect();
    let mut alone = m.new_cache().unwrap();
    m.forward(&mut [SeqInput {
        tokens: &first,
        cache: &mut alone,
    }])
    .unwrap();
    assert_eq!(taken, alone.export_all(16).unwrap());
    assert_ne!(taken, cache.export_all(16).unwrap());
}

/// Every row of a prompt's run scores the token after it as a run that stops there would:
/// what echo's prompt logprobs are read from. Flags change nothing in the last rows.
#[test]
fn every_row_gives_the_logits_of_each_prefix() {
    let m = model();
    let full = prompt(12, 9);
    let other = prompt(5, 2);
    let (mut a, mut b) = (m.new_cache().unwrap(), m.new_cache().unwrap());
    let (last, every) = m
        .forward_rows(
            &mut [
                SeqInput {
                    tokens: &other,
                    cache: &mut a,
                },
                SeqInput {
                    tokens: &full,
                    cache: &mut b,
                },
            ],
            &mut |_, _| Ok(()),
            &[false, true],
        )
        .unwrap();
    assert!(every[0].is_none());
    let rows: Vec<Vec<f32>> = every[1].as_ref().unwrap().to_vec2().unwrap();
    assert_eq!(rows.len(), full.len());
    for (i, row) in rows.iter().enumerate() {
        let alone = m.logits_for(&full[..=i]).unwrap();
        let diff = alone
            .iter()
            .zip(row)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "row {i}: max logit difference {diff}");
    }
    let plain = m
        .forward(&mut [
            SeqInput {
                tokens: &other,
                cache: &mut m.new_cache().unwrap(),
            },
            SeqInput {
                tokens: &full,
                cache: &mut m.new_cache().unwrap(),
            },
        ])
        .unwrap();
    assert!(
        plain.to_vec2::<f32>().unwrap() == last.to_vec2::<f32>().unwrap(),
        "asking for every row changed the last rows"
    );
    let scored = engine::sampling::scored(&rows[..full.len() - 1], &full[1..], 2);
    assert_eq!(scored.len(), full.len() - 1);
    assert!(scored.iter().all(|s| s.logprob <= 0.0 && s.top.len() == 2));
}

/// One decode step over sequences of different lengths gives each the logits its whole
/// prompt gives: the step's rows rotated at each sequence's own position and attended over
/// each cache (on a GPU by the step's own kernels, the prompt by candle's ops), with soft
/// caps and sliding windows (16 positions) shorter and longer than the caches.
#[test]
fn a_decode_step_gives_each_sequence_its_whole_prompt_s_logits() {
    for dir in [
        common::tiny_model_dir(),
        common::tiny_mistral_dir(),
        common::tiny_gemma2_dir(),
    ] {
        step_against_whole_prompts(&dir, &[5, 17, 40], engine::KV_DTYPE);
    }
}

/// The same with a cache long enough (600 positions) for a GPU to attend its keys in runs,
/// each by a block of its own, merged after (`attention::splits`).
#[test]
fn a_decode_step_over_a_long_cache_gives_its_whole_prompt_s_logits() {
    step_against_whole_prompts(&common::tiny_model_dir(), &[5, 600], engine::KV_DTYPE);
}

/// Prompts of `lengths`, all but their last tokens run first, then the last tokens in one
/// step: each step's logits within 1e-4 of its whole prompt's, its greedy token the same,
/// the caches holding `kv`.
pub(crate) fn step_against_whole_prompts(
    dir: &std::path::Path,
    lengths: &[usize],
    kv: engine::KvDtype,
) {
    let m = model_holding(dir, kv);
    let prompts: Vec<Vec<u32>> = lengths.iter().map(|&n| prompt(n, n as u32)).collect();
    let whole: Vec<Vec<f32>> = prompts.iter().map(|p| m.logits_for(p).unwrap()).collect();
    let mut caches: Vec<_> = prompts.iter().map(|_| m.new_cache().unwrap()).collect();
    for (p, c) in prompts.iter().zip(caches.iter_mut()) {
        let (before, _) = p.split_at(p.len() - 1);
        m.forward(&mut [SeqInput {
            tokens: before,
            cache: c,
        }])
        .unwrap();
    }
    let mut batch: Vec<SeqInput> = prompts
        .iter()
        .zip(caches.iter_mut())
        .map(|(p, c)| SeqInput {
            tokens: &p[p.len() - 1..],
            cache: c,
        })
        .collect();
    let stepped: Vec<Vec<f32>> = m.forward(&mut batch).unwrap().to_vec2().unwrap();
    for ((want, got), p) in whole.iter().zip(&stepped).zip(&prompts) {
        let max_diff = want
            .iter()
            .zip(got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let name = dir.display();
        assert!(max_diff < 1e-4, "{name}, {} tokens: {max_diff}", p.len());
        assert_eq!(
            engine::model::argmax(want),
            engine::model::argmax(got),
            "{name}, {} tokens",
            p.len()
        );
    }
}
