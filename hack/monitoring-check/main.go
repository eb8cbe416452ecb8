// monitoring-check checks the chart's monitoring objects as rendered by `helm template`, with
// Prometheus' own libraries (the promql parser and rulefmt of the Prometheus module that
// promtool is built from):
//
//   - the dashboard ConfigMap holds valid JSON; every panel has queries; every PromQL expression
//     in it (panel targets and template variables, Grafana's $variables substituted) parses;
//   - the PrometheusRule's groups parse as a rule file (rulefmt) and every expression parses;
//   - every metric name used by the dashboard and the rules is one keyshift exposes (the list
//     that src/operator/metrics.rs's test keeps in tests/monitoring/metric-names.txt);
//   - every alert has a promtool unit test that expects it to fire and one that expects it not
//     to (tests/monitoring/rules-test.yaml);
//   - the PodMonitor scrapes the workers' control port.
//
// It writes the rules (the PrometheusRule's spec) to OUT/rules.yaml for `promtool check rules`
// and `promtool test rules` (hack/check-monitoring.sh runs both).
//
// Usage: monitoring-check -manifests RENDERED.yaml -names NAMES.txt -rule-tests TESTS.yaml -out DIR
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"
)

type manifest struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Data map[string]string `yaml:"data"`
	Spec yaml.Node         `yaml:"spec"`
}

type problems []string

func (p *problems) add(format string, args ...any) { *p = append(*p, fmt.Sprintf(format, args...)) }

var promql = parser.NewParser(parser.Options{})

// Grafana's variables: ranges become a duration, anything else a plain value (they stand inside
// label matchers' strings).
var grafanaVar = regexp.MustCompile(`\$\{?(__rate_interval|__interval|__range|[A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}?`)

func substitute(expr string) string {
	return grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		name := grafanaVar.FindStringSubmatch(m)[1]
		switch name {
		case "__rate_interval", "__interval", "__range":
			return "5m"
		default:
			return "x"
		}
	})
}

// metricNames parses expr and returns the metric names it selects.
func metricNames(expr string) ([]string, error) {
	node, err := promql.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var names []string
	var nameless error
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if vs.Name == "" {
				nameless = fmt.Errorf("selector %s names no metric", vs.String())
			}
			names = append(names, vs.Name)
		}
		return nil
	})
	return names, nameless
}

var labelValues = regexp.MustCompile(`^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$`)

func checkDashboard(text string, known map[string]bool, p *problems) int {
	var dash struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			Type    string `json:"type"`
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal([]byte(text), &dash); err != nil {
		p.add("dashboard: not valid JSON: %v", err)
		return 0
	}
	if dash.Title == "" || dash.UID == "" {
		p.add("dashboard: no title or uid")
	}
	exprs := 0
	check := func(where, expr string) {
		exprs++
		names, err := metricNames(substitute(expr))
		if err != nil {
			p.add("%s: %q does not parse: %v", where, expr, err)
		}
		for _, n := range names {
			if n != "" && !known[n] {
				p.add("%s: metric %s is not one keyshift exposes", where, n)
			}
		}
	}
	for _, panel := range dash.Panels {
		if panel.Type == "row" {
			continue
		}
		where := fmt.Sprintf("dashboard panel %q", panel.Title)
		if len(panel.Targets) == 0 {
			p.add("%s: no queries", where)
		}
		for _, t := range panel.Targets {
			if strings.TrimSpace(t.Expr) == "" {
				p.add("%s: an empty query", where)
				continue
			}
			check(where, t.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		q := ""
		switch query := v.Query.(type) {
		case string:
			q = query
		case map[string]any:
			q, _ = query["query"].(string)
		}
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			p.add("dashboard variable %s: query %q is not label_values(selector, label)", v.Name, q)
			continue
		}
		check("dashboard variable "+v.Name, m[1])
	}
	if len(dash.Panels) == 0 {
		p.add("dashboard: no panels")
	}
	return exprs
}

func checkRules(text []byte, known map[string]bool, p *problems) []string {
	groups, errs := rulefmt.Parse(text, false, model.UTF8Validation, promql, slog.New(slog.NewTextHandler(io.Discard, nil)))
	for _, err := range errs {
		p.add("rules: %v", err)
	}
	if groups == nil {
		return nil
	}
	var alerts []string
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			where := "rule " + r.Alert + r.Record
			if r.Alert != "" {
				alerts = append(alerts, r.Alert)
			}
			names, err := metricNames(r.Expr)
			if err != nil {
				p.add("%s: %v", where, err)
			}
			for _, n := range names {
				if n != "" && !known[n] {
					p.add("%s: metric %s is not one keyshift exposes", where, n)
				}
			}
		}
	}
	return alerts
}

// checkRuleTests: every alert has a unit test expecting it to fire and one expecting silence.
func checkRuleTests(path string, alerts []string, p *problems) {
	raw, err := os.ReadFile(path)
	if err != nil {
		p.add("rule tests: %v", err)
		return
	}
	var file struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	if err := yaml.Unmarshal(raw, &file); err != nil {
		p.add("rule tests: %v", err)
		return
	}
	fires, silent := map[string]bool{}, map[string]bool{}
	for _, t := range file.Tests {
		for _, a := range t.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				silent[a.Alertname] = true
			}
		}
	}
	for _, a := range alerts {
		if !fires[a] {
			p.add("alert %s: no unit test expects it to fire", a)
		}
		if !silent[a] {
			p.add("alert %s: no unit test expects it to stay silent", a)
		}
	}
}

func readNames(path string) (map[string]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	known := map[string]bool{}
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line != "" && !strings.HasPrefix(line, "#") {
			known[line] = true
		}
	}
	if len(known) == 0 {
		return nil, errors.New("no metric names")
	}
	return known, s.Err()
}

func main() {
	manifests := flag.String("manifests", "", "output of helm template with the monitoring values on")
	namesFile := flag.String("names", "", "the metric names keyshift exposes, one a line")
	ruleTests := flag.String("rule-tests", "", "the promtool unit tests of the alerts")
	out := flag.String("out", "", "directory to write rules.yaml into")
	flag.Parse()
	if *manifests == "" || *namesFile == "" || *ruleTests == "" || *out == "" {
		flag.Usage()
		os.Exit(2)
	}
	known, err := readNames(*namesFile)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", *namesFile, err)
		os.Exit(1)
	}
	raw, err := os.ReadFile(*manifests)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var p problems
	var rules []byte
	dashboards, podMonitors := 0, 0
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	for {
		var doc yaml.Node
		if err := dec.Decode(&doc); err == io.EOF {
			break
		} else if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", *manifests, err)
			os.Exit(1)
		}
		var m manifest
		if err := doc.Decode(&m); err != nil {
			continue
		}
		switch m.Kind {
		case "PrometheusRule":
			if rules != nil {
				p.add("more than one PrometheusRule")
			}
			rules, err = yaml.Marshal(&m.Spec)
			if err != nil {
				p.add("PrometheusRule %s: %v", m.Metadata.Name, err)
			}
		case "ConfigMap":
			if text, ok := m.Data["keyshift.json"]; ok {
				dashboards++
				n := checkDashboard(text, known, &p)
				fmt.Printf("dashboard %s: %d queries checked\n", m.Metadata.Name, n)
			}
		case "PodMonitor":
			podMonitors++
			var spec struct {
				Endpoints []struct {
					Port string `yaml:"port"`
					Path string `yaml:"path"`
				} `yaml:"podMetricsEndpoints"`
			}
			if err := m.Spec.Decode(&spec); err != nil || len(spec.Endpoints) != 1 ||
				spec.Endpoints[0].Port != "control" || spec.Endpoints[0].Path != "/metrics" {
				p.add("PodMonitor %s: must scrape the workers' control port at /metrics: %+v", m.Metadata.Name, spec)
			}
		}
	}
	if dashboards != 1 {
		p.add("expected one dashboard ConfigMap, found %d", dashboards)
	}
	if podMonitors != 1 {
		p.add("expected one PodMonitor, found %d", podMonitors)
	}
	if rules == nil {
		p.add("no PrometheusRule rendered")
	} else {
		alerts := checkRules(rules, known, &p)
		sort.Strings(alerts)
		fmt.Printf("rules: alerts %s\n", strings.Join(alerts, ", "))
		if len(alerts) == 0 {
			p.add("the PrometheusRule has no alerts")
		}
		checkRuleTests(*ruleTests, alerts, &p)
		if err := os.WriteFile(filepath.Join(*out, "rules.yaml"), rules, 0o644); err != nil {
			p.add("writing rules.yaml: %v", err)
		}
	}
	if len(p) > 0 {
		for _, x := range p {
			fmt.Fprintln(os.Stderr, "monitoring-check:", x)
		}
		os.Exit(1)
	}
	fmt.Println("monitoring-check: ok")
}
