//! Prometheus text exposition, written by hand: a few lines per metric need no library.

use std::fmt::{Display, Write};

/// The HELP and TYPE lines of a metric.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One sample of a metric, with its labels.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: impl Display) {
    out.push_str(name);
    if !labels.is_empty() {
        let inner: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        let _ = write!(out, "{{{}}}", inner.join(","));
    }
    let _ = writeln!(out, " {value}");
}

/// A gauge without labels.
pub fn gauge(out: &mut String, name: &str, help: &str, value: impl Display) {
    header(out, name, "gauge", help);
    sample(out, name, &[], value);
}

/// A counter without labels.
pub fn counter(out: &mut String, name: &str, help: &str, value: impl Display) {
    header(out, name, "counter", help);
    sample(out, name, &[], value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_text_format() {
        let mut out = String::new();
        gauge(&mut out, "x_used", "Used.", 3);
        header(&mut out, "x_total", "counter", "By kind.");
        sample(&mut out, "x_total", &[("kind", "a\"b")], 1.5);
        assert_eq!(
            out,
            "# HELP x_used Used.\n# TYPE x_used gauge\nx_used 3\n\
             # HELP x_total By kind.\n# TYPE x_total counter\nx_total{kind=\"a\\\"b\"} 1.5\n"
        );
    }
}
