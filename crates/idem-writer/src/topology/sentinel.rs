//! Sentinel discovery: the primary Sentinel names for a service, checked
//! with `ROLE`, and a watcher that reports `+switch-master` at once.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Client, ConnectionInfo, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::backoff::{sleep_unless, Backoff};
use crate::error::{ensure_config, Context, Error, Result};
use crate::secure::RedisTls;
use crate::topology::target::{parse_url, query_once, role, with_address, Target, QUERY_TIMEOUT};

pub struct SentinelDiscovery {
    sentinels: Vec<ConnectionInfo>,
    service_name: String,
    /// Scheme, credentials and database for the primary.
    template: ConnectionInfo,
}

impl SentinelDiscovery {
    pub fn new(
        sentinel_urls: &[String],
        service_name: &str,
        service_url: &str,
        tls: &RedisTls,
    ) -> Result<Self> {
        ensure_config(
            !sentinel_urls.is_empty(),
            "at least one Sentinel URL is needed",
        )?;
        ensure_config(
            !service_name.is_empty() && !service_name.contains(char::is_whitespace),
            "the Sentinel service name must be one non-empty word",
        )?;
        let sentinels = sentinel_urls
            .iter()
            .map(|url| parse_url(url, tls))
            .collect::<Result<Vec<_>>>()?;
        let template = parse_url(service_url, tls)?;
        with_address(&template, "check", 1)?;
        Ok(SentinelDiscovery {
            sentinels,
            service_name: service_name.to_string(),
            template,
        })
    }

    /// Asks the sentinels in turn for the primary's address, and takes the
    /// first answer whose server says it is a primary (`ROLE`); a server
    /// still a replica (the failover not finished) is not taken.
    pub async fn primary(&self) -> Result<Target> {
        let mut failures = Vec::new();
        for sentinel in &self.sentinels {
            match self.ask(sentinel).await {
                Ok(target) => return Ok(target),
                Err(error) => failures.push(format!("{}: {}", sentinel.addr(), error.report())),
            }
        }
        Err(Error::Topology(format!(
            "no Sentinel named a primary for {}: {}",
            self.service_name,
            failures.join("; ")
        )))
    }

    async fn ask(&self, sentinel: &ConnectionInfo) -> Result<Target> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.service_name);
        let unexpected =
            |reply: &dyn std::fmt::Debug| Error::Topology(format!("unexpected reply {reply:?}"));
        let (host, port) = match query_once(sentinel, &cmd)
            .await
            .context("SENTINEL GET-MASTER-ADDR-BY-NAME")?
        {
            Value::Array(items) => match items.as_slice() {
                [host, port] => {
                    let port = text(port)?.parse::<u16>();
                    (text(host)?, port.map_err(|_| unexpected(&items))?)
                }
                _ => return Err(unexpected(&items)),
            },
            Value::Nil => return Err(Error::Topology("unknown service".to_string())),
            other => return Err(unexpected(&other)),
        };
        let info = with_address(&self.template, &host, port)?;
        let role = role(&info).await?;
        if role != "master" {
            return Err(Error::Topology(format!(
                "{host}:{port} is a {role}, not a primary (yet)"
            )));
        }
        Ok(Target::new(info))
    }

    /// Subscribes to `+switch-master` on one sentinel after another and
    /// notifies `changed` for every switch of this service (and after each
    /// new subscription, in case one was missed meanwhile), until `stop`.
    pub fn watch(
        &self,
        changed: Arc<Notify>,
        stop: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let sentinels = self.sentinels.clone();
        let service_name = self.service_name.clone();
        async move {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
            for sentinel in sentinels.iter().cycle() {
                tokio::select! {
                    result = follow_switches(sentinel, &service_name, &changed) => {
                        debug!(sentinel = %sentinel.addr(), ?result, "Sentinel subscription ended");
                        if result.is_ok() {
                            backoff.reset(); // it was subscribed: not a failing sentinel
                        }
                    }
                    () = stop.cancelled() => return,
                }
                if !sleep_unless(&stop, backoff.next_delay()).await {
                    return;
                }
            }
        }
    }
}

/// One subscription; returns when the connection ends.
async fn follow_switches(
    sentinel: &ConnectionInfo,
    service_name: &str,
    changed: &Notify,
) -> Result<()> {
    let client = Client::open(sentinel.clone()).context("open the Sentinel client")?;
    let mut pubsub = tokio::time::timeout(QUERY_TIMEOUT, client.get_async_pubsub())
        .await
        .map_err(|_| Error::redis_timeout("connect to Sentinel"))?
        .context("connect to Sentinel")?;
    tokio::time::timeout(QUERY_TIMEOUT, pubsub.subscribe("+switch-master"))
        .await
        .map_err(|_| Error::redis_timeout("subscribe to +switch-master"))?
        .context("subscribe to +switch-master")?;
    changed.notify_one();
    let mut messages = pubsub.on_message();
    while let Some(message) = messages.next().await {
        // "<name> <old-ip> <old-port> <new-ip> <new-port>"
        let payload: String = message.get_payload().unwrap_or_default();
        if payload.split_whitespace().next() == Some(service_name) {
            info!(switch = payload, "Sentinel switched the primary");
            changed.notify_one();
        }
    }
    Ok(())
}

fn text(value: &Value) -> Result<String> {
    match value {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Ok(s.clone()),
        other => Err(Error::Topology(format!("expected a string, got {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_its_settings() {
        let ok = SentinelDiscovery::new(
            &["redis://s1:26379".into()],
            "idem",
            "redis://_/2",
            &RedisTls::default(),
        );
        assert_eq!(ok.unwrap().template.redis_settings().db(), 2);
        assert!(SentinelDiscovery::new(&[], "idem", "redis://_/0", &RedisTls::default()).is_err());
        assert!(SentinelDiscovery::new(
            &["redis://s1".into()],
            "two words",
            "redis://_/0",
            &RedisTls::default()
        )
        .is_err());
        assert!(SentinelDiscovery::new(
            &["redis://s1".into()],
            "idem",
            "unix:///x",
            &RedisTls::default()
        )
        .is_err());
    }
}
