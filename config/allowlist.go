package config

import (
	"fmt"
	"net/netip"
	"net/url"
	"path"
	"strings"
)

// AllowList is a pool's allowed_instance_urls: networks (CIDR, or one
// address) that an IP-literal URL host must fall in, and URL patterns
// scheme://host[:port] whose host and port are globs (path.Match: *
// matches any run of characters, ? one). An empty list allows any URL.
type AllowList struct {
	nets []netip.Prefix
	pats []urlPattern
}

type urlPattern struct {
	scheme, host, port string // port "" = any
}

// ParseAllowList parses allowed_instance_urls entries.
func ParseAllowList(entries []string) (AllowList, error) {
	var a AllowList
	for _, e := range entries {
		e = strings.TrimSpace(e)
		scheme, rest, isURL := strings.Cut(e, "://")
		if !isURL {
			p, err := netip.ParsePrefix(e)
			if err != nil {
				addr, aerr := netip.ParseAddr(e)
				if aerr != nil || addr.Zone() != "" {
					return a, fmt.Errorf("%q: want a CIDR network, an IP address or scheme://host[:port]", e)
				}
				p = netip.PrefixFrom(addr.Unmap(), addr.Unmap().BitLen())
			}
			a.nets = append(a.nets, netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-unmapBits(p)).Masked())
			continue
		}
		scheme = strings.ToLower(scheme)
		if scheme != "http" && scheme != "https" {
			return a, fmt.Errorf("%q: scheme must be http or https", e)
		}
		hostport, _, _ := strings.Cut(rest, "/")
		host, port := hostport, ""
		if strings.HasPrefix(hostport, "[") {
			end := strings.IndexByte(hostport, ']')
			if end < 0 {
				return a, fmt.Errorf("%q: unterminated [", e)
			}
			host, port = hostport[1:end], strings.TrimPrefix(hostport[end+1:], ":")
		} else if i := strings.LastIndexByte(hostport, ':'); i >= 0 {
			host, port = hostport[:i], hostport[i+1:]
		}
		if host == "" {
			return a, fmt.Errorf("%q: no host", e)
		}
		for _, g := range []string{host, port} {
			if _, err := path.Match(g, ""); err != nil {
				return a, fmt.Errorf("%q: %w", e, err)
			}
		}
		a.pats = append(a.pats, urlPattern{scheme: scheme, host: strings.ToLower(host), port: port})
	}
	return a, nil
}

// unmapBits is how many of p's bits cover the ::ffff: prefix of an
// IPv4-mapped address (so that ::ffff:10.0.0.0/104 means 10.0.0.0/8).
func unmapBits(p netip.Prefix) int {
	if p.Addr().Is4In6() {
		return 96
	}
	return 0
}

// empty reports a list that allows everything.
func (a AllowList) Empty() bool { return len(a.nets) == 0 && len(a.pats) == 0 }

// allows reports whether an instance may serve at raw.
func (a AllowList) Allows(raw string) bool {
	if a.Empty() {
		return true
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return false
	}
	scheme, host, port := strings.ToLower(u.Scheme), strings.ToLower(u.Hostname()), u.Port()
	if addr, err := netip.ParseAddr(host); err == nil {
		addr = addr.Unmap()
		for _, n := range a.nets {
			if n.Contains(addr) {
				return true
			}
		}
	}
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[scheme]
	}
	for _, p := range a.pats {
		if p.scheme != scheme {
			continue
		}
		if ok, _ := path.Match(p.host, host); !ok {
			continue
		}
		if p.port == "" {
			return true
		}
		if ok, _ := path.Match(p.port, port); ok {
			return true
		}
	}
	return false
}
