//! The `tandem-router` binary's command line, run as a process. Being an integration test
//! of this package, it also makes `cargo test` build the binary that the end-to-end tests
//! start.

use std::process::Command;

fn router(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem-router"))
        .args(args)
        .env_remove("TANDEM_MODEL")
        .output()
        .expect("the router binary runs")
}

#[test]
fn help_lists_the_mindie_aliases_and_exits_zero() {
    let out = router(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--max-iter-times",
        "--kv-reserve-timeout-ms",
        "--tls-ca",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn a_missing_model_or_an_unknown_flag_is_a_usage_error_naming_it() {
    let out = router(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model"));
    let out = router(&["--model", "m.gguf", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
}
