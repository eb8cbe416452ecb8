// gitops-health: how GitOps tools judge a keyshift StreamJob, computed by their own code.
//
// It reads one StreamJob (JSON on stdin, or from the API server with --name) and prints, as one
// JSON document:
//
//   - "kstatus": the result of sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute, the library
//     Flux's health checks and `kubectl wait`-style tooling use (InProgress, Current, Failed,
//     Terminating, ...);
//   - "argocd": the result of the Argo CD health check Lua script given with --lua, run the way
//     Argo CD runs resource customizations: in github.com/yuin/gopher-lua with only the package,
//     base and table libraries, the object as the global `obj`, a one-second limit, and the
//     returned table's status checked against Argo CD's health codes.
//
// Usage:
//
//	gitops-health --lua docs/gitops/streamjob-health.lua < job.json
//	gitops-health --lua docs/gitops/streamjob-health.lua --kubeconfig KUBECONFIG -n NS --name NAME
//
// Built and cached by hack/build-gitops-health.sh; used by tests/gitops.rs and the e2e suite.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

// The StreamJob resource (src/crd.rs).
var streamJobs = schema.GroupVersionResource{Group: "keyshift.dev", Version: "v1alpha1", Resource: "streamjobs"}

// Argo CD's health status codes (gitops-engine's health.HealthStatusCode).
var argoCodes = map[string]bool{
	"Healthy": true, "Progressing": true, "Degraded": true, "Suspended": true, "Missing": true, "Unknown": true,
}

// Argo CD stops a health script after this long.
const luaTimeout = time.Second

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

type report struct {
	Kstatus verdict `json:"kstatus"`
	Argocd  verdict `json:"argocd"`
}

func main() {
	luaPath := flag.String("lua", "", "the Argo CD health check script (required)")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig for --name (default: $KUBECONFIG)")
	namespace := flag.String("n", "default", "namespace of --name")
	name := flag.String("name", "", "read StreamJob NAME from the API server instead of stdin")
	flag.Parse()
	if err := run(*luaPath, *kubeconfig, *namespace, *name, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "gitops-health: %v\n", err)
		os.Exit(1)
	}
}

func run(luaPath, kubeconfig, namespace, name string, stdin io.Reader, stdout io.Writer) error {
	if luaPath == "" {
		return errors.New("--lua SCRIPT is required")
	}
	script, err := os.ReadFile(luaPath)
	if err != nil {
		return err
	}
	var obj *unstructured.Unstructured
	if name != "" {
		obj, err = fetch(kubeconfig, namespace, name)
	} else {
		obj, err = decode(stdin)
	}
	if err != nil {
		return err
	}
	res, err := status.Compute(obj)
	if err != nil {
		return fmt.Errorf("kstatus: %w", err)
	}
	argo, err := argoHealth(obj, string(script))
	if err != nil {
		return fmt.Errorf("argo cd health script %s: %w", luaPath, err)
	}
	out, err := json.Marshal(report{
		Kstatus: verdict{Status: res.Status.String(), Message: res.Message},
		Argocd:  argo,
	})
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s\n", out)
	return err
}

func decode(r io.Reader) (*unstructured.Unstructured, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(data); err != nil {
		return nil, fmt.Errorf("stdin is not a Kubernetes object in JSON: %w", err)
	}
	return obj, nil
}

func fetch(kubeconfig, namespace, name string) (*unstructured.Unstructured, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if kubeconfig != "" {
		rules.ExplicitPath = kubeconfig
	}
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, err
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return client.Resource(streamJobs).Namespace(namespace).Get(ctx, name, metav1.GetOptions{})
}

// argoHealth runs a health check script as Argo CD does.
func argoHealth(obj *unstructured.Unstructured, script string) (verdict, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	// Argo CD's default set (resource.customizations.useOpenLibs off): no string, math, io or os
	// library, so a script that needs one fails here as it would there.
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
	} {
		l.Push(l.NewFunction(lib.open))
		l.Push(lua.LString(lib.name))
		l.Call(1, 0)
	}
	ctx, cancel := context.WithTimeout(context.Background(), luaTimeout)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, obj.Object))
	if err := l.DoString(script); err != nil {
		return verdict{}, err
	}
	ret, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return verdict{}, fmt.Errorf("the script returned %s, not a table", l.Get(-1).Type())
	}
	v := verdict{
		Status:  lua.LVAsString(ret.RawGetString("status")),
		Message: lua.LVAsString(ret.RawGetString("message")),
	}
	if !argoCodes[v.Status] {
		return verdict{}, fmt.Errorf("hs.status %q is not an Argo CD health status", v.Status)
	}
	return v, nil
}

// toLua converts a decoded JSON value: objects become tables keyed by name, arrays tables indexed
// from 1, numbers Lua numbers.
func toLua(l *lua.LState, v interface{}) lua.LValue {
	switch v := v.(type) {
	case map[string]interface{}:
		t := l.NewTable()
		for k, e := range v {
			t.RawSetString(k, toLua(l, e))
		}
		return t
	case []interface{}:
		t := l.NewTable()
		for _, e := range v {
			t.Append(toLua(l, e))
		}
		return t
	case string:
		return lua.LString(v)
	case bool:
		return lua.LBool(v)
	case int64:
		return lua.LNumber(v)
	case float64:
		return lua.LNumber(v)
	default:
		return lua.LNil
	}
}
