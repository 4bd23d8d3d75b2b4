//! Worker discovery through the Kubernetes API: the EndpointSlices of the workers' Services,
//! chosen by a label selector. Each pool's Service selects its pods; the endpoint
//! controller writes one endpoint per pod with the pod's readiness (its readiness probe:
//! model loaded and not draining), so a worker joins when it is ready and leaves when it
//! drains or goes, with nothing registered by the worker itself.
//!
//! Followed with kube-rs' watcher (a list, then a watch from its resourceVersion, listed
//! again when the watch expires or fails, with backoff), and listed again from scratch
//! every `relist` so that a missed event cannot leave a stale worker behind.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;

use crate::{Member, Role, WorkerSet};

/// The label of a Service (copied by the endpoint controller onto its EndpointSlices) that
/// says which pool its pods are: `prefill` or `decode`.
pub const ROLE_LABEL: &str = "app.kubernetes.io/component";
/// The name of the Service port the workers' gRPC listens on.
pub const GRPC_PORT_NAME: &str = "grpc";

/// Why the Kubernetes API cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No in-cluster service account and no usable kubeconfig.
    #[error("no Kubernetes client configuration: {0}")]
    Config(#[source] kube::Error),
}

/// A client from the pod's service account, else from the kubeconfig (`KUBECONFIG`), and
/// the namespace it defaults to (the pod's own, or the kubeconfig context's).
pub async fn client() -> Result<Client, KubeError> {
    Client::try_default().await.map_err(KubeError::Config)
}

/// The workers the endpoints of `slices` describe, by key: each ready endpoint of a slice
/// labelled with a role, at its port named `grpc` (or its only port). A slice or endpoint
/// that says too little is left out.
pub fn members<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> BTreeMap<String, Member> {
    let mut out = BTreeMap::new();
    for slice in slices {
        let role = match slice.labels().get(ROLE_LABEL).map(String::as_str) {
            Some("prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            _ => continue,
        };
        let Some(port) = grpc_port(slice) else {
            continue;
        };
        for ep in &slice.endpoints {
            // Unset means ready (the API's own reading); a terminating pod is never ready.
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let Some(ip) = ep.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            if !ready {
                continue;
            }
            let addr = SocketAddr::new(ip, port).to_string();
            let name = ep
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .or_else(|| ep.hostname.clone())
                .unwrap_or_default();
            let member = Member {
                role,
                addr,
                name,
                registration: None,
            };
            out.insert(format!("k8s/{}/{}", role.as_str(), member.addr), member);
        }
    }
    out
}

/// The slice's gRPC port: the one named `grpc`, else its only one.
fn grpc_port(slice: &EndpointSlice) -> Option<u16> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match ports {
        [only] => only,
        _ => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(GRPC_PORT_NAME))?,
    };
    port.port.and_then(|p| u16::try_from(p).ok())
}

/// Follows the EndpointSlices in `namespace` that `selector` chooses, publishing the
/// workers they describe on `tx`, until every receiver is gone.
pub async fn watch_endpoints(
    client: Client,
    namespace: String,
    selector: String,
    relist: Duration,
    tx: watch::Sender<WorkerSet>,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    loop {
        let period = tokio::time::sleep(relist);
        tokio::select! {
            _ = follow(&api, &selector, &tx) => {}
            _ = period => {}
            _ = tx.closed() => return,
        }
    }
}

/// One period: a fresh list, then the watch's events, applied to the set on `tx`.
async fn follow(api: &Api<EndpointSlice>, selector: &str, tx: &watch::Sender<WorkerSet>) {
    let config = watcher::Config::default().labels(selector);
    let mut events = watcher::watcher(api.clone(), config)
        .default_backoff()
        .boxed();
    let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, EndpointSlice>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listing = Some(BTreeMap::new()),
            Ok(Event::InitApply(s)) => {
                if let Some(l) = listing.as_mut() {
                    l.insert(s.name_any(), s);
                }
            }
            Ok(Event::InitDone) => {
                slices = listing.take().unwrap_or_default();
                publish(tx, &slices);
            }
            Ok(Event::Apply(s)) => {
                slices.insert(s.name_any(), s);
                publish(tx, &slices);
            }
            Ok(Event::Delete(s)) => {
                slices.remove(&s.name_any());
                publish(tx, &slices);
            }
            Err(e) => {
                tx.send_if_modified(|set| !std::mem::replace(&mut set.degraded, true));
                tracing::warn!(error = %e, "Kubernetes API unreachable; routing to the last known workers");
            }
        }
    }
}

/// Publishes the workers `slices` describe, logging who joined and who left.
fn publish(tx: &watch::Sender<WorkerSet>, slices: &BTreeMap<String, EndpointSlice>) {
    crate::watch::resync(tx, members(slices.values()), |was, now| {
        for key in now.workers.keys().filter(|k| !was.workers.contains_key(*k)) {
            tracing::info!(%key, "worker ready");
        }
        for key in was.workers.keys().filter(|k| !now.workers.contains_key(*k)) {
            tracing::info!(%key, "worker left or not ready");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(
        role: Option<&str>,
        ports: serde_json::Value,
        endpoints: serde_json::Value,
    ) -> EndpointSlice {
        let mut labels = serde_json::Map::new();
        if let Some(r) = role {
            labels.insert(ROLE_LABEL.into(), r.into());
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "s", "labels": labels},
            "addressType": "IPv4",
            "ports": ports,
            "endpoints": endpoints,
        }))
        .expect("an EndpointSlice")
    }

    #[test]
    fn ready_endpoints_of_labelled_slices_are_workers_at_their_grpc_port() {
        let ports =
            serde_json::json!([{"name": "metrics", "port": 9464}, {"name": "grpc", "port": 50052}]);
        let eps = serde_json::json!([
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true},
             "targetRef": {"kind": "Pod", "name": "decode-a"}},
            // Unset conditions read as ready, as the API documents.
            {"addresses": ["10.0.0.2"]},
            // Not ready (loading, draining) or terminating: not a worker to route to.
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": true, "terminating": true}},
            {"addresses": ["not an address"]},
            {"addresses": []},
        ]);
        let found = members([&slice(Some("decode"), ports.clone(), eps.clone())]);
        let addrs: Vec<_> = found
            .values()
            .map(|m| (m.addr.as_str(), m.name.as_str()))
            .collect();
        assert_eq!(
            addrs,
            [("10.0.0.1:50052", "decode-a"), ("10.0.0.2:50052", "")]
        );
        assert!(found
            .values()
            .all(|m| m.role == Role::Decode && m.registration.is_none()));
        assert!(found.contains_key("k8s/decode/10.0.0.1:50052"));

        // A slice without a role label, or whose role is neither pool, is not a pool's.
        assert!(members([&slice(None, ports.clone(), eps.clone())]).is_empty());
        assert!(members([&slice(Some("router"), ports, eps.clone())]).is_empty());
        // Several ports and none named grpc: no way to know which to dial.
        let unnamed = serde_json::json!([{"name": "a", "port": 1}, {"name": "b", "port": 2}]);
        assert!(members([&slice(Some("prefill"), unnamed, eps.clone())]).is_empty());
        // One port, whatever its name, is the one.
        let one = serde_json::json!([{"port": 50051}]);
        let found = members([&slice(Some("prefill"), one, eps)]);
        assert_eq!(found.len(), 2);
        assert!(found
            .values()
            .all(|m| m.role == Role::Prefill && m.addr.ends_with(":50051")));
    }

    #[test]
    fn an_ipv6_endpoint_is_dialed_in_brackets() {
        let s = slice(
            Some("prefill"),
            serde_json::json!([{"name": "grpc", "port": 50051}]),
            serde_json::json!([{"addresses": ["fd00::7"]}]),
        );
        let found = members([&s]);
        assert_eq!(
            found.values().next().map(|m| m.addr.as_str()),
            Some("[fd00::7]:50051")
        );
    }
}
