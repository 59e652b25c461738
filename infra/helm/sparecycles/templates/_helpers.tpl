{{- define "sparecycles.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sparecycles.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sparecycles.brokerSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: broker
{{- end -}}

{{/* The broker container's environment: the plain settings, the TLS pair, the Secret. */}}
{{- define "sparecycles.brokerEnv" -}}
env:
  - name: SPARECYCLES_TLS_CERT
    value: /etc/sparecycles/tls/tls.crt
  - name: SPARECYCLES_TLS_KEY
    value: /etc/sparecycles/tls/tls.key
  {{- range $name, $value := .Values.broker.env }}
  - name: {{ $name }}
    value: {{ $value | quote }}
  {{- end }}
envFrom:
  - secretRef:
      name: {{ .Values.broker.existingSecret }}
{{- end -}}

{{- define "sparecycles.securityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
