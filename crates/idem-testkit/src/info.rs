//! Reading `INFO` replies: the `name:value` lines of a section, as text or
//! integers (one parser for the module's tests, the writer's, the example's
//! and the benchmarks).

use std::collections::HashMap;

/// Every `name:value` line of an `INFO` text (section headers skipped).
pub fn info_fields(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// The integer field `name` of an `INFO` text, if present and numeric.
pub fn info_int(text: &str, name: &str) -> Option<i64> {
    text.lines().find_map(|l| {
        let (field, value) = l.split_once(':')?;
        (field == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// `INFO idem` on a connection.
pub fn idem_info_text(conn: &mut redis::Connection) -> String {
    redis::cmd("INFO")
        .arg("idem")
        .query(conn)
        .expect("INFO idem")
}

/// `INFO idem` on an async connection.
pub async fn idem_info_text_async(conn: &mut impl redis::aio::ConnectionLike) -> String {
    redis::cmd("INFO")
        .arg("idem")
        .query_async(conn)
        .await
        .expect("INFO idem")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_integers() {
        let text = "# idem\r\nkeys_new:3\r\nname:x y\r\nkeys_newer:9\r\n";
        assert_eq!(info_int(text, "keys_new"), Some(3));
        assert_eq!(info_int(text, "name"), None);
        assert_eq!(info_int(text, "missing"), None);
        assert_eq!(info_fields(text)["name"], "x y");
        assert_eq!(info_fields(text).len(), 3);
    }
}
