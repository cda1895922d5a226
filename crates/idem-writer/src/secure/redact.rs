//! [`redact_url`]: a connection string fit to print.

/// What a masked secret reads as.
const MASK: &str = "***";

/// `url` with every password masked, for messages, logs and JSON: the
/// password of a URL's user information (`redis://user:secret@host`,
/// `postgres://u:secret@h/db`, each of a comma-separated list), a
/// `password=` query parameter, and a libpq `password=` setting of a
/// key=value connection string (quoted or not). Anything else is kept, so
/// the host, port and database still say which server was meant.
///
/// ```
/// use idem_writer::secure::redact_url;
/// assert_eq!(redact_url("rediss://app:s3cret@cache:6380/0"), "rediss://app:***@cache:6380/0");
/// assert_eq!(redact_url("host=db password='a b' user=u"), "host=db password=*** user=u");
/// ```
pub fn redact_url(url: &str) -> String {
    if url.contains("://") {
        url.split(',')
            .map(redact_one_url)
            .collect::<Vec<_>>()
            .join(",")
    } else {
        redact_conninfo(url)
    }
}

fn redact_one_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut out = url[..rest_start].to_string();
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push(':');
                    out.push_str(MASK);
                }
                None => out.push_str(userinfo),
            }
            out.push_str(&authority[at..]);
        }
        None => out.push_str(authority),
    }
    let tail = &rest[authority_end..];
    match tail.find('?') {
        Some(q) => {
            out.push_str(&tail[..=q]);
            let query = &tail[q + 1..];
            let (query, fragment) = match query.find('#') {
                Some(h) => (&query[..h], &query[h..]),
                None => (query, ""),
            };
            let params: Vec<String> = query
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => {
                        format!("{key}={MASK}")
                    }
                    _ => param.to_string(),
                })
                .collect();
            out.push_str(&params.join("&"));
            out.push_str(fragment);
        }
        None => out.push_str(tail),
    }
    out
}

/// A libpq `key=value` string with its `password` value masked.
fn redact_conninfo(conninfo: &str) -> String {
    let mut out = String::with_capacity(conninfo.len());
    let mut rest = conninfo;
    loop {
        let Some(pos) = find_password_key(rest) else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..pos]);
        let after_key = &rest[pos + "password".len()..];
        let trimmed = after_key.trim_start();
        // `password` followed by `=`, possibly with spaces around it.
        let value_part = trimmed[1..].trim_start();
        out.push_str("password=");
        out.push_str(MASK);
        rest = skip_value(value_part);
    }
}

/// Where a `password` (or `sslpassword`) key's `password` begins: at a word
/// start, followed by `=`.
fn find_password_key(text: &str) -> Option<usize> {
    let lower = text.to_ascii_lowercase();
    let mut from = 0;
    while let Some(found) = lower[from..].find("password") {
        let pos = from + found;
        // `password`, or `sslpassword` (the client key's passphrase).
        let key_start = if lower[..pos].ends_with("ssl") {
            pos - 3
        } else {
            pos
        };
        let at_word_start = key_start == 0 || lower.as_bytes()[key_start - 1].is_ascii_whitespace();
        let followed_by_equals = lower[pos + "password".len()..]
            .trim_start()
            .starts_with('=');
        if at_word_start && followed_by_equals {
            return Some(pos);
        }
        from = pos + 1;
    }
    None
}

/// What follows a value: a quoted one up to its closing quote (with `\`
/// escapes), an unquoted one up to white space.
fn skip_value(value: &str) -> &str {
    if let Some(quoted) = value.strip_prefix('\'') {
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '\'' => return &quoted[i + 1..],
                _ => {}
            }
        }
        ""
    } else {
        let end = value.find(char::is_whitespace).unwrap_or(value.len());
        &value[end..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        for (url, printed) in [
            (
                "redis://:secret@10.0.0.5:6379/0",
                "redis://:***@10.0.0.5:6379/0",
            ),
            (
                "rediss://app:secret@cache:6380",
                "rediss://app:***@cache:6380",
            ),
            ("redis://app@cache:6380/1", "redis://app@cache:6380/1"),
            ("redis://cache:6380", "redis://cache:6380"),
            (
                "redis://:p%40ss@h:1/0#insecure",
                "redis://:***@h:1/0#insecure",
            ),
            // An `@` inside the password: the last one ends the user info.
            ("redis://:a@b@h:1", "redis://:***@h:1"),
            (
                "redis://:one@a:1,redis://:two@b:2",
                "redis://:***@a:1,redis://:***@b:2",
            ),
            (
                "postgres://idem:hunter2@db:5432/idem?sslmode=verify-full",
                "postgres://idem:***@db:5432/idem?sslmode=verify-full",
            ),
            (
                "postgresql://db/idem?user=u&password=hunter2&sslmode=require",
                "postgresql://db/idem?user=u&password=***&sslmode=require",
            ),
            ("unix:///run/redis.sock", "unix:///run/redis.sock"),
            (
                "host=db user=u password=hunter2 dbname=idem",
                "host=db user=u password=*** dbname=idem",
            ),
            (
                "host=db password = 'a \\' b' dbname=idem",
                "host=db password=*** dbname=idem",
            ),
            ("password=x", "password=***"),
            ("host=db sslpassword=x", "host=db sslpassword=***"),
            ("", ""),
        ] {
            let redacted = redact_url(url);
            assert_eq!(redacted, printed, "{url}");
            for secret in ["secret", "hunter2", "p%40ss", "a \\' b"] {
                assert!(!redacted.contains(secret), "{url} -> {redacted}");
            }
        }
    }
}
