#![no_main]
//! Fuzzes `ares_core::rubric`: ratios, step factors, counts, subset selection with an
//! arbitrary (possibly degenerate) generator, message writing with bad indices and
//! non-finite points, and the rubric score.

use ares_core::rubric::{
    GradedSchedule, Reveal, RevealRule, RubricPrompt, StepRule, linear_reveal_count, reveal_count,
    reveal_ratio, rubric_score, sample_criteria, select_criteria, step_factor, uniform_below,
    write_rubric_message,
};
use ares_fuzz::Bytes;

fn step_rule(b: &mut Bytes) -> StepRule<f64> {
    match b.size(4) {
        0 => StepRule::Constant,
        1 => StepRule::StepLinear,
        2 => StepRule::StepPower { power: b.f64() },
        3 => StepRule::step_sigmoid(),
        _ => StepRule::StepSigmoid {
            start_point: b.f64(),
            steepness: b.f64(),
        },
    }
}

fn step_u64(b: &mut Bytes) -> u64 {
    match b.size(3) {
        0 => u64::MAX - b.size(2) as u64,
        1 => 0,
        _ => u64::from(b.u32() % 2000),
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let n = if b.u8() % 32 == 0 {
        usize::MAX
    } else {
        b.size(20)
    };
    let k = if b.u8() % 16 == 0 {
        b.size(40)
    } else {
        b.size(n.min(255))
    };
    let criteria = if b.u8() % 32 == 0 {
        usize::MAX
    } else {
        b.size(40)
    };
    let reveal = if b.bool() {
        RevealRule::Linear
    } else {
        RevealRule::Binary {
            full_reveal_count: b.size(10),
        }
    };
    let sched = GradedSchedule {
        reveal,
        step: step_rule(&mut b),
    };
    let (step, total_steps) = (step_u64(&mut b), step_u64(&mut b));
    let _ = reveal_ratio::<f64>(reveal, k, n);
    let _ = reveal_ratio::<f32>(reveal, k, n);
    let _ = step_factor(&sched.step, step, total_steps);
    let _ = step_factor(&StepRule::StepPower { power: b.f32() }, step, total_steps);
    let _ = linear_reveal_count(k, n, criteria);
    let _ = reveal_count(b.f64(), criteria);
    let _ = reveal_count(b.f32(), criteria);
    let _ = sched.ratio(k, n, step, total_steps);
    let rev = sched.reveal(k, n, step, total_steps, criteria);

    // generator: a few bytes, then a constant (possibly 0, the rejection worst case)
    let draws: Vec<u64> = (0..b.size(8))
        .map(|_| u64::from(b.u32()) << 32 | u64::from(b.u32()))
        .collect();
    let fill = if b.bool() { 0 } else { u64::MAX };
    let mut it = draws.into_iter();
    let mut rng = move || it.next().unwrap_or(fill);
    let _ = uniform_below(u64::from(b.u32()), &mut rng);
    let total = b.size(40);
    let mut shown = vec![0usize; b.size(48)];
    let _ = sample_criteria(b.size(48), total, &mut rng, &mut shown);
    let reveal_arg = match rev {
        Ok(r) if criteria <= 40 => r,
        _ => Reveal::Subset(b.size(48)),
    };
    let _ = select_criteria(reveal_arg, total, &mut rng, &mut shown);
    let _ = reveal_arg.count(total);

    // message
    let texts = ["a", "symptoms", "", "ünï{}\n"];
    let crit: Vec<(&str, f64)> = (0..b.size(12)).map(|i| (texts[i % 4], b.f64())).collect();
    let picks: Vec<usize> = (0..b.size(14)).map(|_| b.size(14)).collect();
    let prompt = RubricPrompt {
        hide_instruction: if b.bool() { None } else { Some("hide") },
        add_base_when_zero: b.bool(),
        ..RubricPrompt::default()
    };
    let mut out = String::new();
    let _ = write_rubric_message(&crit, &picks, &prompt, &mut out);
    let crit32: Vec<(&str, f32)> = crit.iter().map(|&(t, p)| (t, p as f32)).collect();
    let _ = write_rubric_message(&crit32, &picks, &prompt, &mut out);

    let points: Vec<f64> = crit.iter().map(|&(_, p)| p).collect();
    let met: Vec<bool> = (0..if b.u8() % 16 == 0 {
        b.size(14)
    } else {
        points.len()
    })
        .map(|_| b.bool())
        .collect();
    let _ = rubric_score(&points, &met);
    let points32: Vec<f32> = points.iter().map(|&p| p as f32).collect();
    let _ = rubric_score(&points32, &met);
});
