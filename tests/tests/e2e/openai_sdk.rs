//! The README's quickstart command, driven by the official `openai` Python package, and
//! stopped the way a user stops it (Ctrl-C).

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use e2e::{bin_dir, free_port, root, scratch, smollm2, venv_bin};

/// The quickstart script in its own process group, interrupted (as Ctrl-C does) on drop.
struct Quickstart(Child);

impl Quickstart {
    fn interrupt(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", "--", &format!("-{}", self.0.id())])
            .status();
    }
}

impl Drop for Quickstart {
    fn drop(&mut self) {
        self.interrupt();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .status();
        let _ = self.0.wait();
    }
}

fn listening(addr: &str) -> bool {
    TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(200)).is_ok()
}

#[tokio::test]
async fn openai_sdk_against_the_quickstart_cluster() {
    let py = venv_bin("python");
    let model = smollm2();
    let addrs: Vec<String> = (0..4)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let log = scratch().join("quickstart.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new("bash")
        .arg(root().join("scripts/quickstart.sh"))
        .env("TANDEM_BIN_DIR", bin_dir())
        .env("TANDEM_MODELS", model.parent().unwrap())
        .env("ROUTER_LISTEN", &addrs[0])
        .env("PREFILL_LISTEN", &addrs[1])
        .env("DECODE_LISTEN", &addrs[2])
        .env("ROUTER_METRICS_LISTEN", &addrs[3])
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("starting scripts/quickstart.sh");
    let mut qs = Quickstart(child);
    let url = format!("http://{}", addrs[0]);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = client
            .get(format!("http://{}/health/ready", addrs[3]))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline && matches!(qs.0.try_wait(), Ok(None)),
            "quickstart not ready:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = Command::new(&py)
        .arg(root().join("tests/python/openai_client.py"))
        .args(["--base-url", &format!("{url}/v1"), "--model", "smollm2"])
        .status()
        .expect("running the openai client");
    assert!(
        status.success(),
        "the openai client failed; quickstart log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Ctrl-C stops all three processes.
    qs.interrupt();
    let deadline = Instant::now() + Duration::from_secs(15);
    while addrs.iter().any(|a| listening(a)) {
        assert!(
            Instant::now() < deadline,
            "still listening after Ctrl-C: {addrs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waited = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(Some(_)) = qs.0.try_wait() {
            break;
        }
        assert!(
            Instant::now() < waited,
            "quickstart did not exit after Ctrl-C"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
