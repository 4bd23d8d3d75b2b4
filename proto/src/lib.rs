//! The `tandem.v1` gRPC contracts. They carry plain values (token ids, sampling settings, a
//! cache layout) and depend on no engine type; the nodes convert (`kvwire::convert`).

/// Generated messages, clients and servers of `tandem.v1`.
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

pub mod limits;

use prost::Message;

impl v1::GenerateRequest {
    /// Tokens the decode node samples for each sequence: all of `max_tokens` when it
    /// prefills the prompt itself, all but the prefill node's first otherwise.
    pub fn tokens_to_sample(&self) -> u32 {
        if self.prefill_here {
            self.max_tokens
        } else {
            self.max_tokens.saturating_sub(1)
        }
    }
}

/// A worker's error status: `code` and `message` as gRPC has them, and `reason` in the
/// status details, for the router to match.
pub fn error_status(code: tonic::Code, message: String, reason: v1::ErrorReason) -> tonic::Status {
    let detail = v1::ErrorDetail {
        reason: reason.into(),
    };
    tonic::Status::with_details(code, message, detail.encode_to_vec().into())
}

/// The reason a worker gave in `status`; `Unspecified` when it gave none (a status made by
/// the transport, or by a worker of an older build) or one this build does not know.
pub fn error_reason(status: &tonic::Status) -> v1::ErrorReason {
    v1::ErrorDetail::decode(status.details())
        .ok()
        .and_then(|d| v1::ErrorReason::try_from(d.reason).ok())
        .unwrap_or(v1::ErrorReason::Unspecified)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_node_samples_all_but_the_prefilled_first_token() {
        let req = |prefill_here, max_tokens| v1::GenerateRequest {
            prefill_here,
            max_tokens,
            ..Default::default()
        };
        assert_eq!(req(true, 5).tokens_to_sample(), 5);
        assert_eq!(req(false, 5).tokens_to_sample(), 4);
        assert_eq!(req(false, 0).tokens_to_sample(), 0);
    }

    #[test]
    fn the_reason_survives_the_status() {
        let s = error_status(
            tonic::Code::Unavailable,
            "KV transfer to d failed".into(),
            v1::ErrorReason::KvTransfer,
        );
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(s.message(), "KV transfer to d failed");
        assert_eq!(error_reason(&s), v1::ErrorReason::KvTransfer);
    }

    #[test]
    fn a_status_without_details_has_no_reason() {
        assert_eq!(
            error_reason(&tonic::Status::unavailable("KV transfer to d failed")),
            v1::ErrorReason::Unspecified
        );
        let garbage =
            tonic::Status::with_details(tonic::Code::Internal, "x", vec![0xff, 0xff].into());
        assert_eq!(error_reason(&garbage), v1::ErrorReason::Unspecified);
    }
}
