#![no_main]
//! Fuzzes the reply parser of the external rubric grader's protocol (a line
//! `{"met": [bool, …]}`): verdicts of the asked count or an error quoting the reply, never a
//! panic (the quote is cut at a character boundary).

use ares_runner::reward::parse_grader_reply;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for n in 0..4 {
        if let Ok(met) = parse_grader_reply(text, n) {
            assert_eq!(met.len(), n);
        }
    }
});
