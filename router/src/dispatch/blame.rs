//! Whether a failed attempt was its worker's doing. Every attempt path (PD, a short prompt
//! on its decode node, colocated) takes its breaker bookkeeping from [`blame`], so that a
//! client can never take a worker out of rotation by sending requests the worker refuses.

use proto::v1::ErrorReason;
use tonic::Code;

use crate::error::RouterError;

/// What a failed attempt says about the worker it points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// Down or cut off: its breaker counts the failure, and it leaves rotation until a
    /// health probe answers.
    Down,
    /// It failed the call: its breaker counts the failure.
    Fault,
    /// Full or stopping: this request avoids it, and its breaker is untouched.
    Busy,
    /// The request itself was refused (its arguments, its size, its grammar) or
    /// abandoned: nothing counts against the worker.
    Request,
}

/// Whose doing `error` is, for an attempt that had (`progressed`) or had not yet sent the
/// client a piece. A worker's typed reason decides first; a status without one (made by
/// the transport, or by an older worker) is judged by its code. An internal error counts
/// only before progress: after it, the same status may be a request's own constraint
/// failing, and a worker that really broke fails the next request's first piece too.
pub(crate) fn blame(error: &RouterError, progressed: bool) -> Blame {
    match error {
        RouterError::WorkerBusy { .. } => Blame::Busy,
        RouterError::WorkerUnavailable { .. } => Blame::Down,
        RouterError::Worker { status, .. } => of_status(status, progressed),
        // The router's own reading of an answer that broke the contract (no reservation,
        // too few first tokens, a stream cut short).
        RouterError::Internal(_) => Blame::Fault,
        _ => Blame::Request,
    }
}

fn of_status(status: &tonic::Status, progressed: bool) -> Blame {
    match proto::error_reason(status) {
        ErrorReason::InvalidRequest | ErrorReason::KvTooLarge | ErrorReason::Cancelled => {
            Blame::Request
        }
        ErrorReason::QueueFull | ErrorReason::ShuttingDown => Blame::Busy,
        ErrorReason::KvTransfer
        | ErrorReason::KvNotReceived
        | ErrorReason::UnknownDecodeNode
        | ErrorReason::Forbidden => Blame::Fault,
        ErrorReason::Internal | ErrorReason::Unspecified => match status.code() {
            Code::Unavailable => Blame::Down,
            Code::ResourceExhausted => Blame::Busy,
            Code::DeadlineExceeded
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::Unimplemented => Blame::Fault,
            Code::Internal | Code::Unknown | Code::DataLoss | Code::Aborted if !progressed => {
                Blame::Fault
            }
            _ => Blame::Request,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(code: Code, reason: ErrorReason) -> RouterError {
        let status = proto::error_status(code, "x".into(), reason);
        RouterError::worker("decode", "10.0.0.1:1", status)
    }

    fn bare(status: tonic::Status) -> RouterError {
        RouterError::worker("decode", "10.0.0.1:1", status)
    }

    #[test]
    fn a_refusal_of_the_request_never_counts_against_the_worker() {
        for progressed in [false, true] {
            for e in [
                worker(Code::InvalidArgument, ErrorReason::KvTooLarge),
                worker(Code::InvalidArgument, ErrorReason::InvalidRequest),
                worker(Code::AlreadyExists, ErrorReason::InvalidRequest),
                bare(tonic::Status::invalid_argument("bad token")),
                bare(tonic::Status::out_of_range("message too large")),
                RouterError::param("max_tokens", "too many"),
                RouterError::QuotaExceeded { used: 1, quota: 1 },
                RouterError::Timeout(5),
            ] {
                assert_eq!(blame(&e, progressed), Blame::Request, "{e}");
            }
        }
    }

    #[test]
    fn outages_and_broken_answers_count() {
        for progressed in [false, true] {
            assert_eq!(
                blame(&bare(tonic::Status::unavailable("reset")), progressed),
                Blame::Down
            );
            for e in [
                bare(tonic::Status::deadline_exceeded("slow")),
                worker(Code::DeadlineExceeded, ErrorReason::KvNotReceived),
                worker(Code::Internal, ErrorReason::KvTransfer),
                worker(Code::FailedPrecondition, ErrorReason::UnknownDecodeNode),
                bare(tonic::Status::permission_denied("wrong role")),
                worker(Code::PermissionDenied, ErrorReason::Forbidden),
                RouterError::Internal("no reservation".into()),
            ] {
                assert_eq!(blame(&e, progressed), Blame::Fault, "{e}");
            }
        }
    }

    #[test]
    fn an_internal_error_counts_only_before_the_first_piece() {
        for e in [
            worker(Code::Internal, ErrorReason::Internal),
            bare(tonic::Status::internal("step failed")),
            bare(tonic::Status::unknown("?")),
        ] {
            assert_eq!(blame(&e, false), Blame::Fault, "{e}");
            assert_eq!(blame(&e, true), Blame::Request, "{e}");
        }
    }

    #[test]
    fn a_full_or_stopping_worker_is_busy() {
        let full = worker(Code::ResourceExhausted, ErrorReason::QueueFull);
        assert!(matches!(full, RouterError::WorkerBusy { .. }));
        assert_eq!(blame(&full, false), Blame::Busy);
        let stopping = worker(Code::FailedPrecondition, ErrorReason::ShuttingDown);
        assert_eq!(blame(&stopping, false), Blame::Busy);
    }
}
