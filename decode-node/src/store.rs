//! Tickets: a Generate call whose KV comes from a prefill node reserves the memory first and
//! is given a ticket for the transfer; the transfer must present it. A ticket is single use,
//! unguessable (256 random bits), bound to the request id, prompt length and generation
//! length it was issued for, and valid until its call stops waiting. Nothing is allocated
//! for a transfer before its ticket is redeemed, and the cache it brings is allocated from
//! the reservation the ticket carries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use engine::{Sampled, SeqCache};
use subtle::ConstantTimeEq;
use tokio::sync::oneshot;

use crate::budget::Lease;
use crate::error::DecodeError;

/// Bytes of a ticket.
pub const TICKET_BYTES: usize = 32;

/// A complete transfer: the prompt's cache, the first token of each sequence, and the
/// reservation they are held under.
pub struct Arrived {
    pub cache: SeqCache,
    pub first_tokens: Vec<Sampled>,
    pub lease: Lease,
}

/// How a transfer ended, for the call that waits for it.
pub type Delivery = Result<Arrived, DecodeError>;

/// What a ticket was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// Prompt positions the transfer must carry.
    pub prompt: usize,
    /// Tokens to generate after the first: a header may ask for fewer, never more.
    pub max_new: usize,
    /// Positions the cache is allocated with (prompt, first token, max_new, in blocks).
    pub positions: usize,
}

struct Pending {
    ticket: [u8; TICKET_BYTES],
    reserved: Reserved,
    lease: Lease,
    deliver: oneshot::Sender<Delivery>,
}

/// A redeemed ticket: what the transfer may fill, the reservation it fills it under, and
/// where its outcome goes.
pub struct Redeemed {
    pub reserved: Reserved,
    pub lease: Lease,
    pub deliver: oneshot::Sender<Delivery>,
}

/// Tickets issued and not yet redeemed, by request id.
#[derive(Default)]
pub struct Tickets {
    pending: Mutex<HashMap<String, Pending>>,
}

impl Tickets {
    /// An empty table.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Issues the ticket of request `id`, holding `lease` until the transfer redeems it;
    /// the receiver gets the transfer's outcome. A second ticket for an id that holds one
    /// is refused.
    pub fn issue(
        &self,
        id: &str,
        reserved: Reserved,
        lease: Lease,
    ) -> Result<([u8; TICKET_BYTES], oneshot::Receiver<Delivery>), DecodeError> {
        let mut ticket = [0u8; TICKET_BYTES];
        getrandom::fill(&mut ticket)
            .map_err(|e| DecodeError::Internal(format!("no randomness for a ticket: {e}")))?;
        let (deliver, rx) = oneshot::channel();
        let mut pending = self.pending.lock().expect("tickets lock");
        if pending.contains_key(id) {
            return Err(DecodeError::Duplicate(id.to_string()));
        }
        pending.insert(
            id.to_string(),
            Pending {
                ticket,
                reserved,
                lease,
                deliver,
            },
        );
        Ok((ticket, rx))
    }

    /// Redeems the ticket a transfer's header presents for request `id`. A wrong ticket
    /// leaves the right one in place (a guess costs its sender the connection, not the
    /// request); the right one is gone once presented, whatever follows.
    pub fn redeem(&self, id: &str, ticket: &[u8]) -> Result<Redeemed, DecodeError> {
        let mut pending = self.pending.lock().expect("tickets lock");
        let matches = pending
            .get(id)
            .is_some_and(|p| bool::from(p.ticket.as_slice().ct_eq(ticket)));
        if !matches {
            return Err(DecodeError::BadTicket);
        }
        let p = pending.remove(id).expect("the entry was just found");
        Ok(Redeemed {
            reserved: p.reserved,
            lease: p.lease,
            deliver: p.deliver,
        })
    }

    /// Withdraws the ticket of `id` if it was not redeemed: its call stopped waiting. The
    /// ticket is then refused, and its reservation goes back.
    pub fn withdraw(&self, id: &str) {
        self.pending.lock().expect("tickets lock").remove(id);
    }

    /// Tickets issued and not yet redeemed.
    pub fn len(&self) -> usize {
        self.pending.lock().expect("tickets lock").len()
    }

    /// True when no ticket is outstanding.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::KvBudget;

    fn reserved() -> Reserved {
        Reserved {
            prompt: 10,
            max_new: 5,
            positions: 16,
        }
    }

    async fn lease(budget: &KvBudget) -> Lease {
        budget.reserve(2).await.unwrap().0
    }

    fn budget() -> KvBudget {
        let layout = engine::KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            dtype: engine::KV_DTYPE,
        };
        KvBudget::new(layout, 100, 16, 10, 4)
    }

    #[tokio::test]
    async fn a_ticket_is_redeemed_once_and_only_by_its_bytes() {
        let (tickets, budget) = (Tickets::new(), budget());
        let (ticket, _rx) = tickets
            .issue("a", reserved(), lease(&budget).await)
            .unwrap();
        let mut other = ticket;
        other[TICKET_BYTES - 1] ^= 1;
        for wrong in [
            &other[..],
            &ticket[..TICKET_BYTES - 1],
            b"",
            &[0u8; TICKET_BYTES],
        ] {
            assert!(matches!(
                tickets.redeem("a", wrong),
                Err(DecodeError::BadTicket)
            ));
        }
        assert!(
            matches!(tickets.redeem("b", &ticket), Err(DecodeError::BadTicket)),
            "a ticket is bound to its request id"
        );
        assert_eq!(tickets.len(), 1, "wrong tickets leave the right one");
        let r = tickets.redeem("a", &ticket).ok().unwrap();
        assert_eq!(r.reserved, reserved());
        assert_eq!(r.lease.blocks(), 2);
        assert!(
            matches!(tickets.redeem("a", &ticket), Err(DecodeError::BadTicket)),
            "a replayed ticket is refused"
        );
        assert!(tickets.is_empty());
    }

    #[tokio::test]
    async fn tickets_differ_and_an_id_holds_one() {
        let (tickets, budget) = (Tickets::new(), budget());
        let (a, _ra) = tickets
            .issue("a", reserved(), lease(&budget).await)
            .unwrap();
        let (b, _rb) = tickets
            .issue("b", reserved(), lease(&budget).await)
            .unwrap();
        assert_ne!(a, b);
        assert!(matches!(
            tickets.issue("a", reserved(), lease(&budget).await),
            Err(DecodeError::Duplicate(_))
        ));
    }

    #[tokio::test]
    async fn a_withdrawn_ticket_is_refused_and_its_reservation_freed() {
        let (tickets, budget) = (Tickets::new(), budget());
        let (ticket, _rx) = tickets
            .issue("a", reserved(), lease(&budget).await)
            .unwrap();
        assert_eq!(budget.used(), 2);
        tickets.withdraw("a");
        assert_eq!(budget.used(), 0, "the reservation went back");
        assert!(matches!(
            tickets.redeem("a", &ticket),
            Err(DecodeError::BadTicket)
        ));
    }
}
